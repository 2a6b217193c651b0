"""kiln's settings, one package: every setting declared once (table.py) with its auto rule
(rules.py) and value parser (values.py); the sources a value comes from (sources.py: CLI flags,
KILN_* env, the config file); resolution with provenance (resolve.py); the engine's frozen view
(engine_config.py); and docs/flags.md generated from the table (docs.py).

Nothing is re-exported here: import the module that holds the name, so the import says where it
lives."""
