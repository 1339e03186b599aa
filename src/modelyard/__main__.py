from modelyard.cli.main import main

main()
