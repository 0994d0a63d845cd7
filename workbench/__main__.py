from workbench.frontends.cli import main

raise SystemExit(main())
