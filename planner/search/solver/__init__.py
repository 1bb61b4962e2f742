"""The solver: the CP-SAT model (``cp_sat``), ``--fix`` handling (``fixes``) and infeasibility explanations and
searches (``explain``). Only ``cp_sat`` imports OR-Tools; import it where a solve happens."""
