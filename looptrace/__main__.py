from looptrace.cli.main import main

main()
