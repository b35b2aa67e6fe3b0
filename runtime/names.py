"""Names shared across the packages, defined once: the graph inputs a program binds by name,
and the ``meta`` keys passes write on nodes and graphs and later passes, the lowering and the
program read.

Here, in the lowest package, because the runtime binds inputs by name; ``passes`` and
``dcp_compile`` import them from here.
"""

from __future__ import annotations

# -- Graph inputs (placeholder names) ---------------------------------------------------------

RANK_INPUT = "tp_rank"            # 0-d int64: this rank (insert_rank adds it)

# -- Collective group names -------------------------------------------------------------------

ROLE_PREFIX = "dcp_role:"         # a collective's group in a graph: ROLE_PREFIX + role name
