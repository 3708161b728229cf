"""The node prediction (`glmctl plan --predict`): one tensor-parallel rank as a TP1 model (`rank`),
its steps measured on a stand-in GPU (`rank_sim_records`), scaled to the 8x L40 node's decode
(`node_prediction`, `node_whole_step`) and prefill (`node_prefill`); the records they share are
`node_records`."""
