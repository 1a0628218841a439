/**
 * One stage graph: [embedding] → layers first..last → [final norm + lm_head], with the I/O names
 * of shards/contract.ts. Cut points are options, so one builder makes every split.
 */
import type { LayerWeights, ModelSpec } from '../architectures.ts'
import {
  ATTENTION_MASK, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, NUM_LOGITS_TO_KEEP, POSITION_IDS,
  GREEDY_TOKEN, NEW_KV, newKeyName, newValueName, presentKeyName, presentValueName, type DecodeAttentionForm, type Quantization,
} from '../contract.ts'
import type { F32Tensor } from '../safetensors.ts'
import { DT, GraphBuilder } from './builder.ts'
import { makeEmbedding, makeLayers, makeLmHead } from './blocks.ts'
import type { BuildContext, OpTable } from './types.ts'

export interface StageSource {
  embed: () => Promise<F32Tensor>
  finalNorm: () => Promise<F32Tensor>
  /** lm_head weight [V, D]; for tied models this is the embedding. */
  lmHead: () => Promise<F32Tensor>
  layer: (l: number) => Promise<LayerWeights>
}

export interface StageOptions {
  spec: ModelSpec
  layers: [number, number]
  hasEmbedding: boolean
  hasHead: boolean
  ops: OpTable
  quant: Quantization
  accuracyLevel: number
  dataFile: string
  /** 'ort-contrib' stages: the one-position attention's form (default 'per-head'). */
  decodeAttention?: DecodeAttentionForm
}

export async function buildStage (src: StageSource, o: StageOptions): Promise<GraphBuilder> {
  const g = new GraphBuilder(o.dataFile)
  // 'ort-contrib' stages are run by an engine that keeps its KV in place (daemon/engine
  // runner-in-place.ts): one-position steps attend over the past buffer where it is.
  const ctx: BuildContext = { g, spec: o.spec, ops: o.ops, quant: o.quant, accuracyLevel: o.accuracyLevel, decodeInPlace: o.ops.name === 'ort-contrib', ...(o.decodeAttention === undefined ? {} : { decodeAttention: o.decodeAttention }) }
  const { hiddenSize: D, numKvHeads: kvH, headDim: hd } = o.spec.shape
  let x: string
  let embedShared: F32Tensor | undefined
  if (o.hasEmbedding) {
    const ids = g.input(INPUT_IDS, DT.INT64, ['batch_size', 'sequence_length'])
    embedShared = await src.embed()
    x = makeEmbedding(ctx, ids, embedShared)
  } else {
    x = g.input(HIDDEN_IN, DT.FLOAT, ['batch_size', 'sequence_length', D])
  }
  const positionIds = g.input(POSITION_IDS, DT.INT64, ['batch_size', 'sequence_length'])
  const mask = g.input(ATTENTION_MASK, DT.INT64, ['batch_size', 'total_sequence_length'])
  const tables = o.ops.stageTables(ctx, positionIds, mask, o.hasEmbedding ? INPUT_IDS : HIDDEN_IN)
  const kvDims = ['batch_size', kvH, 'past_sequence_length', hd]
  const presentDims = ['batch_size', kvH, 'total_sequence_length', hd]
  const { out, presents } = await makeLayers(ctx, o.layers, x, src.layer, tables, kvDims)
  x = out
  if (o.hasHead) {
    const keep = g.input(NUM_LOGITS_TO_KEEP, DT.INT64, [])
    const tied = o.spec.shape.tieWordEmbeddings
    const head = tied && embedShared !== undefined ? embedShared : await src.lmHead()
    const logits = makeLmHead(ctx, x, keep, await src.finalNorm(), head, tied && embedShared !== undefined ? 'model.embed_tokens.weight' : 'lm_head.weight', tied && embedShared !== undefined)
    // The greedy token in the graph (in-place graphs, whose engine fetches it): a greedy step then
    // fetches one int64 a row instead of the logits — the binding copies every fetched output into
    // new JS memory (1 MB a step for eight rows of a 32k vocabulary) and the JS argmax took ~30 µs
    // a row; TopK's k = 1 takes ~10 (docs/engine-notes.md, wave 14), and runs unfetched too.
    const greedy = ctx.decodeInPlace === true && tables.kind === 'gqa'
      ? (g.node('TopK', '/model/greedy/TopK', [logits, g.i64([1])], { axis: -1, largest: 1, sorted: 1 }, 2) as [string, string])[1]
      : undefined
    g.output(LOGITS, logits, DT.FLOAT, ['batch_size', 'logits_to_keep', head.shape[0]!])
    if (greedy !== undefined) g.output(GREEDY_TOKEN, greedy, DT.INT64, ['batch_size', 'logits_to_keep', 1])
  } else {
    g.output(HIDDEN_OUT, x, DT.FLOAT, ['batch_size', 'sequence_length', D])
  }
  // In-place decode ('ort-contrib': GroupQueryAttention tables) gives each layer's new columns
  // only (attention.ts gqaAttention); no present exists there.
  const newOnly = ctx.decodeInPlace === true && tables.kind === 'gqa'
  const dims = newOnly ? ['batch_size', kvH, 'sequence_length', hd] : presentDims
  // The same columns as one output, which an engine fetches instead of two a layer: onnxruntime-node
  // costs ~6 µs a fetched output (16 of them ~0.1 ms of a 60m step; docs/engine-notes.md, wave 13).
  // The per-layer outputs stay for readers of the older contract (they cost nothing unfetched).
  // Made before them: naming an output renames its producer's value, and the Concat's inputs with it.
  if (newOnly) {
    const all = g.op('Concat', '/model/new_key_values/Concat', presents.flatMap(([, k, v]) => [k, v]), { axis: 1 })
    g.output(NEW_KV, all, DT.FLOAT, ['batch_size', 2 * presents.length * kvH, 'sequence_length', hd])
  }
  for (const [l, k, v] of presents) {
    g.output(newOnly ? newKeyName(l) : presentKeyName(l), k, DT.FLOAT, dims)
    g.output(newOnly ? newValueName(l) : presentValueName(l), v, DT.FLOAT, dims)
  }
  return g
}
