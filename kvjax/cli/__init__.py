"""The `python -m kvjax.run` command, one idea a module:

- `args`: the flags, parsed and checked before the model loads (`parse_args`,
  `check_tasks`, `check_scope`, `UsageError`);
- `sweep`: the product of methods x budgets x tasks x contexts (`plan`) and its measurement
  on shared prefills (`measure`), one record a job;
- `records`: the output file, written record by record, and `--resume` (`Output`);
- `signals`: Ctrl-C and SIGTERM, which keep every finished record;
- `main`: the command itself.
"""
