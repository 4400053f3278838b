"""The ``hpctrain`` command line. Library packages never import this one."""
