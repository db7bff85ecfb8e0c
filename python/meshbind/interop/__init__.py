"""The plans users already have (SPEC §9), checked by meshbind and applied by the framework
that owns them."""
