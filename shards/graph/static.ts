/**
 * Fixed-shape stage graphs for NPUs (`shoal shard --static CTX[,CHUNK]`): batch 1, S new positions
 * (CHUNK for prefill, 1 for decode), over a KV buffer of CTX slots that each run writes in place by
 * slot (ScatterElements, no Concat: the buffer never changes shape), with an explicit attention
 * mask over the slots. Built from the same blocks as the dynamic graphs with the portable
 * 'standard' op table, only the attention primitive and its tables swapped, so the weights, names
 * and every other op are the dynamic standard graph's. I/O: shards/contract.ts (static graphs).
 */
import type { ModelSpec } from '../architectures.ts'
import {
  ATTENTION_MASK, CACHE_POSITION, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, POSITION_IDS,
  presentKeyName, presentValueName, type Quantization,
} from '../contract.ts'
import type { F32Tensor } from '../safetensors.ts'
import { groupedAttention, rotaryCosSin } from './attention.ts'
import { DT, GraphBuilder } from './builder.ts'
import { makeEmbedding, makeLayers, makeLmHead } from './blocks.ts'
import { OP_TABLES } from './ops.ts'
import type { StageSource } from './stage.ts'
import type { AttentionIo, AttentionOut, BuildContext, OpTable, StageTables } from './types.ts'

/**
 * cos/sin [1, 1, S, hd] from position_ids (as the standard tables), allowed[0, 0, 0, i, j] =
 * j <= cache_position[i] && attention_mask[0, j] over the CTX slots, and the slot indices
 * broadcast to the KV update's shape.
 */
function staticTables (contextLength: number, steps: number, cachePosition: string) {
  return (ctx: BuildContext, positionIds: string, attentionMask: string): StageTables => {
    const { g } = ctx
    const { numKvHeads: kvH, headDim: hd } = ctx.spec.shape
    const { cos, sin } = rotaryCosSin(ctx, positionIds)

    let n = '/model/attn_mask'
    const slotsCol = g.op('Reshape', `${n}/query/Reshape`, [cachePosition, g.i64([steps, 1])])
    const keys = g.i64(Array.from({ length: contextLength }, (_, j) => j), [1, contextLength])
    const causal = g.op('LessOrEqual', `${n}/causal/LessOrEqual`, [keys, slotsCol])
    const real = g.op('Cast', `${n}/pad/Cast`, [attentionMask], { to: DT.BOOL })
    const allowed = g.op('And', `${n}/And`, [causal, real])
    n = '/model/kv_slots'
    const slots = g.op('Expand', `${n}/Expand`, [g.op('Reshape', `${n}/Reshape`, [cachePosition, g.i64([1, 1, steps, 1])]), g.i64([1, kvH, steps, hd])])
    return { kind: 'static', cos, sin, allowed: g.op('Reshape', `${n}/allowed/Reshape`, [allowed, g.i64([1, 1, 1, steps, contextLength])]), slots }
  }
}

/**
 * Grouped-query attention over the whole KV buffer: the new keys/values are scattered into their
 * slots, then every query attends over all CTX slots with the mask (masked scores become the
 * lowest f32, whose softmax weight is exactly 0, so stale or padding slots contribute nothing).
 */
function staticAttention (ctx: BuildContext, n: string, wn: string, io: AttentionIo, t: StageTables): AttentionOut {
  if (t.kind !== 'static') throw new Error('static attention needs static stage tables')
  const { g } = ctx
  return groupedAttention(ctx, n, wn, io, t.cos, t.sin, t.allowed, (kh, vh) => [
    g.op('ScatterElements', `${n}/k_cache/ScatterElements`, [io.pastK, t.slots, kh], { axis: 2 }),
    g.op('ScatterElements', `${n}/v_cache/ScatterElements`, [io.pastV, t.slots, vh], { axis: 2 }),
  ])
}

export interface StaticStageOptions {
  spec: ModelSpec
  layers: [number, number]
  hasEmbedding: boolean
  hasHead: boolean
  quant: Quantization
  accuracyLevel: number
  /** Shared by a stage's prefill and decode graphs: both write the same weights in the same order. */
  dataFile: string
  /** KV buffer slots (CTX). */
  contextLength: number
  /** New positions per run: the prefill chunk, or 1 for decode. */
  steps: number
}

export async function buildStaticStage (src: StageSource, o: StaticStageOptions): Promise<GraphBuilder> {
  const g = new GraphBuilder(o.dataFile)
  const { hiddenSize: D, numKvHeads: kvH, headDim: hd } = o.spec.shape
  const S = o.steps
  const C = o.contextLength
  const cachePosition = g.input(CACHE_POSITION, DT.INT64, [S])
  const ops: OpTable = { ...OP_TABLES.standard, stageTables: staticTables(C, S, cachePosition), attention: staticAttention }
  const ctx: BuildContext = { g, spec: o.spec, ops, quant: o.quant, accuracyLevel: o.accuracyLevel }
  let x: string
  let embedShared: F32Tensor | undefined
  if (o.hasEmbedding) {
    const ids = g.input(INPUT_IDS, DT.INT64, [1, S])
    embedShared = await src.embed()
    // Portable: a plain Gather over the dequantized table when the embedding is int4 (same numbers).
    x = makeEmbedding(ctx, ids, embedShared, true)
  } else {
    x = g.input(HIDDEN_IN, DT.FLOAT, [1, S, D])
  }
  const positionIds = g.input(POSITION_IDS, DT.INT64, [1, S])
  const mask = g.input(ATTENTION_MASK, DT.INT64, [1, C])
  const tables = ops.stageTables(ctx, positionIds, mask, '')
  const kvDims = [1, kvH, C, hd]
  const { out, presents } = await makeLayers(ctx, o.layers, x, src.layer, tables, kvDims)
  x = out
  if (o.hasHead) {
    const tied = o.spec.shape.tieWordEmbeddings && embedShared !== undefined
    const head = tied ? embedShared! : await src.lmHead()
    // Keep = 0 (a constant): every position's logits, so the shape stays fixed; the engine takes
    // the rows it needs (the last real one, or several for speculative verification).
    const logits = makeLmHead(ctx, x, g.i64([0], []), await src.finalNorm(), head, tied ? 'model.embed_tokens.weight' : 'lm_head.weight', tied)
    g.output(LOGITS, logits, DT.FLOAT, [1, S, head.shape[0]!])
  } else {
    g.output(HIDDEN_OUT, x, DT.FLOAT, [1, S, D])
  }
  for (const [l, k, v] of presents) {
    g.output(presentKeyName(l), k, DT.FLOAT, kvDims)
    g.output(presentValueName(l), v, DT.FLOAT, kvDims)
  }
  return g
}
