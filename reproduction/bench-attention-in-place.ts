/**
 * What GroupQueryAttention still costs over a KV cache kept in place, and what attention in
 * standard ops over the same buffer would cost instead (issue 11, the next lever after the
 * in-place cache). Only the attention part of 8 decoder layers of the 60m shape (dim 512, 8 q
 * heads, 2 kv heads, head dim 64): fp32 q/k/v/o projections as plain MatMuls, random weights, no
 * rotary in either variant, batch B of rows with different lengths.
 *
 *   (G) today's engine: GroupQueryAttention over a past buffer with room ([B, kvH, W, hd], each
 *       row's first L_b columns live; seqlens_k per row), its present not fetched, the new columns
 *       out through GatherND; onnxruntime copies every row's past into the present each step.
 *   (S) the same buffer read in place by standard ops: scores of the past (masked per row by an
 *       additive bias input) and of the new column, their max, Exp, the sums and P·V as MatMuls
 *       (the sum as a MatMul with a ones vector, so that masked columns, exact zeros, cannot move
 *       a real column's place in any reduction), one division; nothing is copied.
 *
 * Both write each step's new columns into the buffer from JS, as the engine does. Checked: S
 * against G (max |Δ|), and S's bit-identity for a row whatever the buffer's width and the batch
 * around it (row 0 run alone in a narrow buffer vs in the batch in a wide one).
 *
 * Run: node reproduction/bench-attention-in-place.ts [--contexts 16,256,1024] [--batches 1,8] [--steps 40]
 */
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'
import { cpus, tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import { DT, GraphBuilder, MS_DOMAIN } from '../shards/graph/builder.ts'
import { createRng } from '../daemon/engine/index.ts'
import { loadAverage, upperMedian } from './lib/index.ts'
import { DIM, GROUP, H, HD, KVH, LAYERS, SCALE } from './lib/attention-shape.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values } = parseArgs({
  options: {
    contexts: { type: 'string', default: '16,256,1024' },
    batches: { type: 'string', default: '1,8' },
    steps: { type: 'string', default: '40' },
  },
})
const STEPS = Number(values.steps)
const ROOM = 32

const rand = createRng(7)
const randn = (n: number, scale: number): Float32Array => {
  const a = new Float32Array(n)
  for (let i = 0; i < n; i++) a[i] = (rand() * 2 - 1) * scale
  return a
}
const W = Array.from({ length: LAYERS }, () => ({ q: randn(DIM * DIM, 0.08), k: randn(DIM * KVH * HD, 0.08), v: randn(DIM * KVH * HD, 0.08), o: randn(DIM * DIM, 0.08) }))

function projections (g: GraphBuilder, l: number, x: string): { q: string, k: string, v: string } {
  const n = `/l${l}`
  return {
    q: g.op('MatMul', `${n}/q/MatMul`, [x, g.f32Weight(`w${l}.q`, [DIM, DIM], W[l]!.q)]),
    k: g.op('MatMul', `${n}/k/MatMul`, [x, g.f32Weight(`w${l}.k`, [DIM, KVH * HD], W[l]!.k)]),
    v: g.op('MatMul', `${n}/v/MatMul`, [x, g.f32Weight(`w${l}.v`, [DIM, KVH * HD], W[l]!.v)]),
  }
}

const dir = join(tmpdir(), `shoal-attn-in-place-${process.pid}`)
function save (g: GraphBuilder, name: string): string {
  mkdirSync(dir, { recursive: true })
  writeFileSync(join(dir, g.dataFile), Buffer.concat(g.data()))
  const path = join(dir, `${name}.onnx`)
  writeFileSync(path, g.encode(name, 'attention over an in-place KV cache'))
  return path
}

/** (G) GroupQueryAttention over the past buffer; new columns by GatherND (as the compiler emits). */
function buildG (): string {
  const g = new GraphBuilder('g.data')
  let x = g.input('x', DT.FLOAT, ['B', 1, DIM])
  const seqlensK = g.input('seqlens_k', DT.INT32, ['B'])
  const total = g.input('total_sequence_length', DT.INT32, [1])
  const cols = g.input('new_columns', DT.INT64, ['B', KVH, 1, 1])
  for (let l = 0; l < LAYERS; l++) {
    const { q, k, v } = projections(g, l, x)
    const pk = g.input(`past.${l}.key`, DT.FLOAT, ['B', KVH, 'W', HD])
    const pv = g.input(`past.${l}.value`, DT.FLOAT, ['B', KVH, 'W', HD])
    const [ctx, presK, presV] = g.node('GroupQueryAttention', `/l${l}/GroupQueryAttention`, [q, k, v, pk, pv, seqlensK, total],
      { num_heads: H, kv_num_heads: KVH, scale: { float: SCALE } }, 3, MS_DOMAIN) as [string, string, string]
    const nk = g.op('GatherND', `/l${l}/nk/GatherND`, [presK, cols], { batch_dims: 2 })
    const nv = g.op('GatherND', `/l${l}/nv/GatherND`, [presV, cols], { batch_dims: 2 })
    x = g.op('MatMul', `/l${l}/o/MatMul`, [ctx, g.f32Weight(`w${l}.o`, [DIM, DIM], W[l]!.o)])
    g.output(`new.${l}.key`, nk, DT.FLOAT, ['B', KVH, 1, HD])
    g.output(`new.${l}.value`, nv, DT.FLOAT, ['B', KVH, 1, HD])
  }
  g.output('out', x, DT.FLOAT, ['B', 1, DIM])
  return save(g, 'g')
}

/** (S) standard ops over the same past buffer, read in place. */
function buildS (): string {
  const g = new GraphBuilder('s.data')
  let x = g.input('x', DT.FLOAT, ['B', 1, DIM])
  const bias = g.input('bias', DT.FLOAT, ['B', 1, 1, 'W']) // 0 live, -inf elsewhere
  const ones = g.input('ones', DT.FLOAT, ['W', 1])
  for (let l = 0; l < LAYERS; l++) {
    const n = `/l${l}`
    const { q, k, v } = projections(g, l, x)
    const heads = (name: string, y: string, count: number): string =>
      g.op('Transpose', `${n}/${name}/Transpose`, [g.op('Reshape', `${n}/${name}/Reshape`, [y, g.i64([0, 1, count, HD])])], { perm: [0, 2, 1, 3] })
    const kn = heads('k', k, KVH) // [B, kvH, 1, hd]
    const vn = heads('v', v, KVH)
    const qg = g.op('Reshape', `${n}/q/Reshape`, [g.op('Mul', `${n}/q/Mul`, [q, g.f32(SCALE)]), g.i64([0, KVH, GROUP, HD])]) // [B, kvH, group, hd]
    const pk = g.input(`past.${l}.key`, DT.FLOAT, ['B', KVH, 'W', HD])
    const pv = g.input(`past.${l}.value`, DT.FLOAT, ['B', KVH, 'W', HD])
    const sp = g.op('Add', `${n}/sp/Add`, [g.op('MatMul', `${n}/sp/MatMul`, [qg, g.op('Transpose', `${n}/pk/Transpose`, [pk], { perm: [0, 1, 3, 2] })]), bias]) // [B, kvH, group, W]
    const sn = g.op('MatMul', `${n}/sn/MatMul`, [qg, g.op('Transpose', `${n}/kn/Transpose`, [kn], { perm: [0, 1, 3, 2] })]) // [B, kvH, group, 1]
    const m = g.op('Max', `${n}/m/Max`, [g.op('ReduceMax', `${n}/m/ReduceMax`, [sp], { axes: [-1], keepdims: 1 }), sn])
    const ep = g.op('Exp', `${n}/ep/Exp`, [g.op('Sub', `${n}/ep/Sub`, [sp, m])])
    const en = g.op('Exp', `${n}/en/Exp`, [g.op('Sub', `${n}/en/Sub`, [sn, m])])
    const sum = g.op('Add', `${n}/sum/Add`, [g.op('MatMul', `${n}/sum/MatMul`, [ep, ones]), en])
    const num = g.op('Add', `${n}/num/Add`, [g.op('MatMul', `${n}/num/MatMul`, [ep, pv]), g.op('Mul', `${n}/num/Mul`, [en, vn])])
    const ctx = g.op('Reshape', `${n}/ctx/Reshape`, [g.op('Div', `${n}/ctx/Div`, [num, sum]), g.i64([0, 1, DIM])])
    x = g.op('MatMul', `${n}/o/MatMul`, [ctx, g.f32Weight(`w${l}.o`, [DIM, DIM], W[l]!.o)])
    g.output(`new.${l}.key`, kn, DT.FLOAT, ['B', KVH, 1, HD])
    g.output(`new.${l}.value`, vn, DT.FLOAT, ['B', KVH, 1, HD])
  }
  g.output('out', x, DT.FLOAT, ['B', 1, DIM])
  return save(g, 's')
}

const opts: ort.InferenceSession.SessionOptions = { executionProviders: ['cpu'], graphOptimizationLevel: 'all', intraOpNumThreads: cpus().length, interOpNumThreads: 1, logSeverityLevel: 3, extra: { session: { intra_op: { allow_spinning: '0' } } } }
const G = await ort.InferenceSession.create(buildG(), opts)
const S = await ort.InferenceSession.create(buildS(), opts)
const fetches = ['out', ...Array.from({ length: LAYERS }, (_, l) => [`new.${l}.key`, `new.${l}.value`]).flat()]

/** A batch's cache: one buffer per layer and kind, rows of `width` columns, lengths per row. */
interface Cache { width: number, rows: number, lengths: number[], k: Float32Array[], v: Float32Array[] }
function cacheFor (lengths: number[], width: number, seed: number): Cache {
  const rows = lengths.length
  const r = createRng(seed)
  const fill = (): Float32Array => {
    const a = new Float32Array(rows * KVH * width * HD)
    lengths.forEach((len, b) => { for (let h = 0; h < KVH; h++) for (let i = 0; i < len * HD; i++) a[((b * KVH + h) * width) * HD + i] = r() * 2 - 1 })
    return a
  }
  return { width, rows, lengths: [...lengths], k: Array.from({ length: LAYERS }, fill), v: Array.from({ length: LAYERS }, fill) }
}
/** Row `from` of `src` as the only row of a new cache `width` wide. */
function rowOf (src: Cache, from: number, width: number): Cache {
  const len = src.lengths[from]!
  const copy = (a: Float32Array): Float32Array => {
    const out = new Float32Array(KVH * width * HD)
    for (let h = 0; h < KVH; h++) out.set(a.subarray(((from * KVH + h) * src.width) * HD, ((from * KVH + h) * src.width + len) * HD), h * width * HD)
    return out
  }
  return { width, rows: 1, lengths: [len], k: src.k.map(copy), v: src.v.map(copy) }
}

async function step (which: 'G' | 'S', c: Cache, x: Float32Array): Promise<{ ms: number, out: Float32Array }> {
  const B = c.rows
  const feeds: Record<string, ort.Tensor> = { x: new ort.Tensor('float32', x, [B, 1, DIM]) }
  if (which === 'G') {
    const maxLen = Math.max(...c.lengths)
    feeds.seqlens_k = new ort.Tensor('int32', Int32Array.from(c.lengths), [B])
    feeds.total_sequence_length = new ort.Tensor('int32', Int32Array.of(maxLen + 1), [1])
    const cols = new BigInt64Array(B * KVH)
    c.lengths.forEach((len, b) => cols.fill(BigInt(len), b * KVH, (b + 1) * KVH))
    feeds.new_columns = new ort.Tensor('int64', cols, [B, KVH, 1, 1])
  } else {
    const bias = new Float32Array(B * c.width).fill(-Infinity)
    c.lengths.forEach((len, b) => bias.fill(0, b * c.width, b * c.width + len))
    feeds.bias = new ort.Tensor('float32', bias, [B, 1, 1, c.width])
    feeds.ones = new ort.Tensor('float32', new Float32Array(c.width).fill(1), [c.width, 1])
  }
  for (let l = 0; l < LAYERS; l++) {
    feeds[`past.${l}.key`] = new ort.Tensor('float32', c.k[l]!, [B, KVH, c.width, HD])
    feeds[`past.${l}.value`] = new ort.Tensor('float32', c.v[l]!, [B, KVH, c.width, HD])
  }
  const began = performance.now()
  const res = await (which === 'G' ? G : S).run(feeds, fetches)
  for (let l = 0; l < LAYERS; l++) {
    for (const [kind, buf] of [['key', c.k[l]!], ['value', c.v[l]!]] as const) {
      const src = res[`new.${l}.${kind}`]!.data as Float32Array
      for (let b = 0; b < B; b++) for (let h = 0; h < KVH; h++) buf.set(src.subarray((b * KVH + h) * HD, (b * KVH + h + 1) * HD), ((b * KVH + h) * c.width + c.lengths[b]!) * HD)
    }
  }
  const ms = performance.now() - began
  c.lengths = c.lengths.map(n => n + 1)
  return { ms, out: res.out!.data as Float32Array }
}

console.log(`bench-attention-in-place: ${cpus().length} CPUs (${cpus()[0]?.model}), load ${loadAverage()}; ${LAYERS} layers of the 60m attention, ${STEPS} steps`)
console.log('\n| batch | context | GQA ms/step | standard ops ms/step | standard / GQA | max |Δ| vs GQA | row 0 alone (narrow buffer) = in the batch (wide) |\n|---|---|---|---|---|---|---|')
try {
  for (const B of values.batches.split(',').map(Number)) {
    for (const ctx of values.contexts.split(',').map(Number)) {
      // Rows of different lengths (ctx, ctx − 3, …), as a continuous batch has them.
      const lengths = Array.from({ length: B }, (_, b) => Math.max(1, ctx - 3 * b))
      const width = ctx + STEPS + ROOM
      const cg = cacheFor(lengths, width, ctx)
      const cs = cacheFor(lengths, width, ctx)
      const alone = rowOf(cs, 0, lengths[0]! + STEPS + 1) // no room past what it needs: another width
      const tg: number[] = []
      const ts: number[] = []
      let maxDiff = 0
      let sameBits = true
      for (let t = 0; t < STEPS; t++) {
        const x = randn(B * DIM, 1)
        const order = t % 2 === 0 ? ['G', 'S'] as const : ['S', 'G'] as const
        const outs: Record<string, Float32Array> = {}
        for (const which of order) {
          const r = await step(which, which === 'G' ? cg : cs, x)
          ;(which === 'G' ? tg : ts).push(r.ms)
          outs[which] = r.out
        }
        for (let i = 0; i < outs.G!.length; i++) maxDiff = Math.max(maxDiff, Math.abs(outs.G![i]! - outs.S![i]!))
        const solo = (await step('S', alone, x.slice(0, DIM))).out
        for (let i = 0; i < DIM; i++) if (solo[i] !== outs.S![i]) sameBits = false
      }
      const g = upperMedian(tg.slice(5))
      const s = upperMedian(ts.slice(5))
      console.log(`| ${B} | ${ctx} | ${g.toFixed(2)} | ${s.toFixed(2)} | **${(s / g).toFixed(2)}** | ${maxDiff.toExponential(1)} | ${sameBits ? 'yes' : 'NO'} |`)
    }
  }
} finally {
  rmSync(dir, { recursive: true, force: true })
}
console.log(`\nload at end: ${loadAverage()}`)
