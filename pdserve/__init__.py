"""pdserve: a disaggregated prefill/decode LLM serving cluster.

One import name for the whole project. This package is the composition root (the `pdserve`
CLI and the local launcher, which wire the roles together); the layers live in the folders
the project was designed with and appear here under `pdserve.*`:

    pdserve.common          the bottom layer: config, protocol, transport, engine, KV transfer
    pdserve.gateway         the HTTP front end and placement
    pdserve.prefill_node    pdserve.decode_node    pdserve.colocated_node    the node roles
    pdserve.loadgen         the load generator

In the source tree those are symbolic links (`pdserve/common -> ../common`), so a checkout
imports as it installs; a built wheel holds real files under `pdserve/` only. The layering
(roles and loadgen above common, nodes independent of each other, no torch in the gateway or
loadgen) is checked by import-linter (`make lint`, `.importlinter`).
"""

from pdserve.common.numerics import limit_torch

limit_torch()  # PDSERVE_CPU_ISA=avx2 limits torch's and oneDNN's ISA: before their first use
