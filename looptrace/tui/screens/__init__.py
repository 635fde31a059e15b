"""One Screen per view: dashboard, diff, help."""
