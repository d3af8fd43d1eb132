from frontend.top.cli import main

main()
