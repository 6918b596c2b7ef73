"""The store: schema, engines, migrations and every SQL statement trajgate runs. It knows no HTTP."""
