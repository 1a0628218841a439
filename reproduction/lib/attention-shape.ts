/**
 * The attention part of the generated 60m model (shards/testmodel `generateTestModel('60m')`),
 * which the attention-only benches build: 8 layers, dim 512, 8 query heads over 2 KV heads of 64.
 */
export const LAYERS = 8
export const DIM = 512
export const H = 8
export const KVH = 2
export const HD = 64
export const GROUP = H / KVH
export const SCALE = 1 / Math.sqrt(HD)
