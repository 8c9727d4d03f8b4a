from benchmarks.operator_scale.cli import main

raise SystemExit(main())
