"""Package layout that pyproject.toml alone cannot express: every `looptrace*` package plus the top-level
`recipes/` folder, shipped inside the wheel as `looptrace.recipe_files` (read with importlib.resources)."""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["looptrace*"]), "looptrace.recipe_files"],
    package_dir={"looptrace.recipe_files": "recipes"},
    package_data={
        "looptrace.recipe_files": ["*.yaml"],
        "looptrace": ["py.typed", "**/*.tcss", "assets/**/*"],
    },
)
