"""The compression core every method is built from (no method lives here):

- `cache`: the fixed-shape KV cache pytree and its pure operations;
- `layer`: what a method's hooks see of one layer (`LayerIO`) and hand back (`LayerKV`,
  `Rows`);
- `method`: the method protocol, the hooks the engine calls and their defaults;
- `scoring`: window attention, pooling, GQA reduction, cumulative attention, value norms;
- `selection`: top-k into fixed slots, compaction, decode-time eviction;
- `budgets`: static budget schedules (uniform, PyramidKV) and AdaKV's flattened top-k;
- `eviction`: the prefill/decode eviction bases the SnapKV family and its relatives use.
"""
