"""The plans users already have, checked by meshbind and applied by the framework
that owns them."""
