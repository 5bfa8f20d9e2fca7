from kvwall.cli import main

raise SystemExit(main())
