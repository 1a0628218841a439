/**
 * Split attention over a frozen and a recent KV cache vs GroupQueryAttention with past/present
 * (issue 11). Only the attention part of 8 decoder layers of the 60m shape (dim 512, 8 q heads,
 * 2 kv heads, head dim 64), fp32 q/k/v/o projections as plain MatMuls, random weights; no rotary
 * in either variant (so both compute the same function), no norms, no MLP.
 *
 *   (A) today's shape: com.microsoft GroupQueryAttention with past_key/past_value [1, 2, L, 64]
 *       inputs and present outputs [1, 2, L+1, 64] fetched every step (GQA's concat plus
 *       onnxruntime-node's copy of each present into a new JS ArrayBuffer), fed back next step.
 *   (B) split: a frozen cache that is only an input, one tensor per layer and kv head [F, 64],
 *       each a zero-copy view of the first F rows of its own JS capacity buffer (seq-major, so a
 *       prefix is contiguous and no Transpose copies it); plus a recent cache [1, 2, r, 64] as
 *       input and [1, 2, r+1, 64] as output (the new row appended). Scores = concat(q·Kfᵀ, q·Krᵀ)
 *       scaled, one Softmax, then P_f·V_f + P_r·V_r, standard ops only. When the recent output
 *       reaches R rows, JS copies its oldest R−1 rows into the frozen buffers and keeps the newest
 *       one as the next recent input (timed, inside the step that does it).
 *
 * Per context the two variants start from the same random cache and get the same random input
 * each step; steps alternate A, B (order swapped every step); both outputs are compared.
 *
 * Run: node reproduction/bench-split-attention.ts [--contexts 16,256,1024,2048] [--steps 60]
 *      [--warmup 10] [--recent 32] [--threads 2]
 */
import { mkdirSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir, cpus } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import { DT, GraphBuilder, MS_DOMAIN } from '../shards/graph/builder.ts'
import { loadAverage, mean, upperMedian } from './lib/index.ts'
import { DIM, GROUP, H, HD, KVH, LAYERS, SCALE } from './lib/attention-shape.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values } = parseArgs({
  options: {
    contexts: { type: 'string', default: '16,256,1024,2048' },
    steps: { type: 'string', default: '60' },
    warmup: { type: 'string', default: '10' },
    recent: { type: 'string', default: '32' },
    threads: { type: 'string', default: '2' },
  },
})
const CONTEXTS = values.contexts.split(',').map(Number)
const STEPS = Number(values.steps)
const WARMUP = Number(values.warmup)
const R = Number(values.recent)
const THREADS = Number(values.threads)

// Deterministic pseudo-random normals (same weights in both graphs).
function rng (seed: number): () => number {
  let s = seed >>> 0
  const u = (): number => { s = (s * 1664525 + 1013904223) >>> 0; return (s + 0.5) / 4294967296 }
  return () => Math.sqrt(-2 * Math.log(u())) * Math.cos(2 * Math.PI * u())
}
function randn (n: number, scale: number, next: () => number): Float32Array {
  const a = new Float32Array(n)
  for (let i = 0; i < n; i++) a[i] = next() * scale
  return a
}

interface Weights { q: Float32Array, k: Float32Array, v: Float32Array, o: Float32Array }
const wr = rng(1)
const WEIGHTS: Weights[] = Array.from({ length: LAYERS }, () => ({
  q: randn(DIM * DIM, 1 / Math.sqrt(DIM), wr),
  k: randn(DIM * KVH * HD, 1 / Math.sqrt(DIM), wr),
  v: randn(DIM * KVH * HD, 1 / Math.sqrt(DIM), wr),
  o: randn(DIM * DIM, 1 / Math.sqrt(DIM), wr),
}))

function projections (g: GraphBuilder, l: number, x: string): { q: string, k: string, v: string } {
  const w = WEIGHTS[l]!
  const n = `/l${l}`
  return {
    q: g.op('MatMul', `${n}/q/MatMul`, [x, g.f32Weight(`w${l}.q`, [DIM, DIM], w.q)]),
    k: g.op('MatMul', `${n}/k/MatMul`, [x, g.f32Weight(`w${l}.k`, [DIM, KVH * HD], w.k)]),
    v: g.op('MatMul', `${n}/v/MatMul`, [x, g.f32Weight(`w${l}.v`, [DIM, KVH * HD], w.v)]),
  }
}

function save (g: GraphBuilder, dir: string, name: string): string {
  mkdirSync(dir, { recursive: true })
  writeFileSync(join(dir, g.dataFile), Buffer.concat(g.data()))
  const path = join(dir, `${name}.onnx`)
  writeFileSync(path, g.encode(name, 'split attention benchmark'))
  return path
}

/** (A) GroupQueryAttention with past/present, no rotary. */
function buildA (dir: string): string {
  const g = new GraphBuilder('a.data')
  let x = g.input('x', DT.FLOAT, [1, 1, DIM])
  const seqlensK = g.input('seqlens_k', DT.INT32, [1])
  const total = g.input('total_sequence_length', DT.INT32, [1])
  for (let l = 0; l < LAYERS; l++) {
    const { q, k, v } = projections(g, l, x)
    const pk = g.input(`past.${l}.key`, DT.FLOAT, [1, KVH, 'L', HD])
    const pv = g.input(`past.${l}.value`, DT.FLOAT, [1, KVH, 'L', HD])
    const [ctx, presK, presV] = g.node('GroupQueryAttention', `/l${l}/GroupQueryAttention`, [q, k, v, pk, pv, seqlensK, total],
      { num_heads: H, kv_num_heads: KVH, scale: { float: SCALE } }, 3, MS_DOMAIN) as [string, string, string]
    g.output(`present.${l}.key`, presK, DT.FLOAT, [1, KVH, 'T', HD])
    g.output(`present.${l}.value`, presV, DT.FLOAT, [1, KVH, 'T', HD])
    x = g.op('MatMul', `/l${l}/o/MatMul`, [ctx, g.f32Weight(`w${l}.o`, [DIM, DIM], WEIGHTS[l]!.o)])
  }
  g.output('out', x, DT.FLOAT, [1, 1, DIM])
  return save(g, dir, 'a')
}

/** (B) frozen (input only, per kv head [F, hd]) + recent (input/output) with one softmax. */
function buildB (dir: string): string {
  const g = new GraphBuilder('b.data')
  let x = g.input('x', DT.FLOAT, [1, 1, DIM])
  for (let l = 0; l < LAYERS; l++) {
    const n = `/l${l}`
    const { q, k, v } = projections(g, l, x)
    // New row as [1, kvH, 1, hd], appended to the recent cache.
    const heads = (name: string, y: string): string =>
      g.op('Transpose', `${n}/${name}/Transpose`, [g.op('Reshape', `${n}/${name}/Reshape`, [y, g.i64([1, 1, KVH, HD])])], { perm: [0, 2, 1, 3] })
    const rkIn = g.input(`recent.${l}.key`, DT.FLOAT, [1, KVH, 'r', HD])
    const rvIn = g.input(`recent.${l}.value`, DT.FLOAT, [1, KVH, 'r', HD])
    const rk = g.op('Concat', `${n}/rk/Concat`, [rkIn, heads('k', k)], { axis: 2 })
    const rv = g.op('Concat', `${n}/rv/Concat`, [rvIn, heads('v', v)], { axis: 2 })
    // q as [kvH, group, hd] (head h = g·group + j), scaled once.
    const qs = g.op('Mul', `${n}/q/Mul`, [g.op('Reshape', `${n}/q/Reshape`, [q, g.i64([KVH, GROUP, HD])]), g.f32(SCALE)])
    const qg = g.node('Split', `${n}/q/Split`, [qs], { axis: 0 }, KVH) // each [1, group, hd]
    const fk: string[] = []
    const fv: string[] = []
    const fScores: string[] = []
    for (let h = 0; h < KVH; h++) {
      fk.push(g.input(`frozen.${l}.key.${h}`, DT.FLOAT, ['F', HD]))
      fv.push(g.input(`frozen.${l}.value.${h}`, DT.FLOAT, ['F', HD]))
      const kt = g.op('Transpose', `${n}/fk${h}/Transpose`, [fk[h]!], { perm: [1, 0] })
      fScores.push(g.op('MatMul', `${n}/fs${h}/MatMul`, [qg[h]!, kt])) // [1, group, F]
    }
    const sf = g.op('Concat', `${n}/sf/Concat`, fScores, { axis: 0 }) // [kvH, group, F]
    const rk3 = g.op('Reshape', `${n}/rk/Reshape`, [rk, g.i64([KVH, -1, HD])])
    const rv3 = g.op('Reshape', `${n}/rv/Reshape`, [rv, g.i64([KVH, -1, HD])])
    const sr = g.op('MatMul', `${n}/sr/MatMul`, [qs, g.op('Transpose', `${n}/rk/Transpose`, [rk3], { perm: [0, 2, 1] })]) // [kvH, group, r+1]
    const p = g.op('Softmax', `${n}/Softmax`, [g.op('Concat', `${n}/s/Concat`, [sf, sr], { axis: 2 })], { axis: -1 })
    const F = g.op('Shape', `${n}/F/Shape`, [fk[0]!], { start: 0, end: 1 })
    const pf = g.op('Slice', `${n}/pf/Slice`, [p, g.i64([0]), F, g.i64([2])])
    const pr = g.op('Slice', `${n}/pr/Slice`, [p, F, g.i64([2 ** 62]), g.i64([2])])
    const pfg = g.node('Split', `${n}/pf/Split`, [pf], { axis: 0 }, KVH)
    const cf = g.op('Concat', `${n}/cf/Concat`, fv.map((vh, h) => g.op('MatMul', `${n}/cf${h}/MatMul`, [pfg[h]!, vh])), { axis: 0 }) // [kvH, group, hd]
    const cr = g.op('MatMul', `${n}/cr/MatMul`, [pr, rv3])
    const ctx = g.op('Reshape', `${n}/ctx/Reshape`, [g.op('Add', `${n}/ctx/Add`, [cf, cr]), g.i64([1, 1, DIM])])
    x = g.op('MatMul', `${n}/o/MatMul`, [ctx, g.f32Weight(`w${l}.o`, [DIM, DIM], WEIGHTS[l]!.o)])
    // Declared after their uses: output() renames the producer's output in the nodes so far.
    g.output(`recent_out.${l}.key`, rk, DT.FLOAT, [1, KVH, 'r1', HD])
    g.output(`recent_out.${l}.value`, rv, DT.FLOAT, [1, KVH, 'r1', HD])
  }
  g.output('out', x, DT.FLOAT, [1, 1, DIM])
  return save(g, dir, 'b')
}

interface Row { ctx: number, aMed: number, bMed: number, aMean: number, bMean: number, merge: number, merges: number, maxDiff: number }

async function measure (a: ort.InferenceSession, b: ort.InferenceSession, ctx: number): Promise<Row> {
  const total = WARMUP + STEPS
  const cap = ctx + total + 1
  const r = rng(1000 + ctx)
  // The same random cache for both: A's [1, kvH, L, hd] and B's per-head [cap, hd] buffers.
  const init = Array.from({ length: LAYERS }, () => ({ k: randn(KVH * ctx * HD, 1, r), v: randn(KVH * ctx * HD, 1, r) }))
  let pastA: ort.Tensor[] = init.flatMap(c => [new ort.Tensor('float32', c.k, [1, KVH, ctx, HD]), new ort.Tensor('float32', c.v, [1, KVH, ctx, HD])])
  // B keeps the last context row in its recent cache (a recent input is never empty).
  const frozenBuf = init.map(c => ({
    k: Array.from({ length: KVH }, (_, h) => { const f = new Float32Array(cap * HD); f.set(c.k.subarray(h * ctx * HD, (h + 1) * ctx * HD - HD)); return f }),
    v: Array.from({ length: KVH }, (_, h) => { const f = new Float32Array(cap * HD); f.set(c.v.subarray(h * ctx * HD, (h + 1) * ctx * HD - HD)); return f }),
  }))
  let F = ctx - 1
  const lastRow = (c: Float32Array): Float32Array => {
    const out = new Float32Array(KVH * HD)
    for (let h = 0; h < KVH; h++) out.set(c.subarray((h * ctx + ctx - 1) * HD, (h * ctx + ctx) * HD), h * HD)
    return out
  }
  let recent: ort.Tensor[] = init.flatMap(c => [new ort.Tensor('float32', lastRow(c.k), [1, KVH, 1, HD]), new ort.Tensor('float32', lastRow(c.v), [1, KVH, 1, HD])])
  let frozen: Record<string, ort.Tensor> = {}
  const makeFrozen = (): void => {
    frozen = {}
    for (let l = 0; l < LAYERS; l++) {
      for (let h = 0; h < KVH; h++) {
        frozen[`frozen.${l}.key.${h}`] = new ort.Tensor('float32', frozenBuf[l]!.k[h]!.subarray(0, F * HD), [F, HD])
        frozen[`frozen.${l}.value.${h}`] = new ort.Tensor('float32', frozenBuf[l]!.v[h]!.subarray(0, F * HD), [F, HD])
      }
    }
  }
  makeFrozen()

  const aT: number[] = []
  const bT: number[] = []
  let mergeMs = 0
  let merges = 0
  let maxDiff = 0
  let len = ctx
  for (let i = 0; i < total; i++) {
    const x = new ort.Tensor('float32', randn(DIM, 1, r), [1, 1, DIM])
    let outA: Float32Array | undefined
    let outB: Float32Array | undefined
    const stepA = async (): Promise<void> => {
      const feeds: Record<string, ort.Tensor> = {
        x,
        seqlens_k: new ort.Tensor('int32', Int32Array.from([len]), [1]),
        total_sequence_length: new ort.Tensor('int32', Int32Array.from([len + 1]), [1]),
      }
      for (let l = 0; l < LAYERS; l++) { feeds[`past.${l}.key`] = pastA[2 * l]!; feeds[`past.${l}.value`] = pastA[2 * l + 1]! }
      const t = performance.now()
      const out = await a.run(feeds)
      const dt = performance.now() - t
      pastA = []
      for (let l = 0; l < LAYERS; l++) pastA.push(out[`present.${l}.key`]!, out[`present.${l}.value`]!)
      outA = out.out!.data as Float32Array
      if (i >= WARMUP) aT.push(dt)
    }
    const stepB = async (): Promise<void> => {
      const feeds: Record<string, ort.Tensor> = { x, ...frozen }
      for (let l = 0; l < LAYERS; l++) { feeds[`recent.${l}.key`] = recent[2 * l]!; feeds[`recent.${l}.value`] = recent[2 * l + 1]! }
      const t = performance.now()
      const out = await b.run(feeds)
      recent = []
      for (let l = 0; l < LAYERS; l++) recent.push(out[`recent_out.${l}.key`]!, out[`recent_out.${l}.value`]!)
      const rows = recent[0]!.dims[2]!
      let tm = performance.now()
      if (rows >= R) {
        // Merge: the oldest rows−1 recent rows go into the frozen buffers; the newest stays recent.
        const move = rows - 1
        const next: ort.Tensor[] = []
        for (let l = 0; l < LAYERS; l++) {
          for (const [j, kind] of (['k', 'v'] as const).entries()) {
            const src = recent[2 * l + j]!.data as Float32Array
            const keep = new Float32Array(KVH * HD)
            for (let h = 0; h < KVH; h++) {
              frozenBuf[l]![kind][h]!.set(src.subarray(h * rows * HD, (h * rows + move) * HD), F * HD)
              keep.set(src.subarray((h * rows + move) * HD, (h * rows + rows) * HD), h * HD)
            }
            next.push(new ort.Tensor('float32', keep, [1, KVH, 1, HD]))
          }
        }
        F += move
        makeFrozen()
        recent = next
        const now = performance.now()
        if (i >= WARMUP) { mergeMs += now - tm; merges++ }
        tm = now
      }
      outB = out.out!.data as Float32Array
      if (i >= WARMUP) bT.push(tm - t)
    }
    if (i % 2 === 0) { await stepA(); await stepB() } else { await stepB(); await stepA() }
    for (let j = 0; j < DIM; j++) maxDiff = Math.max(maxDiff, Math.abs(outA![j]! - outB![j]!))
    len++
  }
  return { ctx, aMed: upperMedian(aT), bMed: upperMedian(bT), aMean: mean(aT), bMean: mean(bT), merge: mergeMs, merges, maxDiff }
}

const dir = join(tmpdir(), `shoal-split-attention-${process.pid}`)
const opts: ort.InferenceSession.SessionOptions = {
  executionProviders: ['cpu'], graphOptimizationLevel: 'all', intraOpNumThreads: THREADS, interOpNumThreads: 1, logSeverityLevel: 3,
  extra: { session: { intra_op: { allow_spinning: '0' } } },
}
const sa = await ort.InferenceSession.create(buildA(dir), opts)
const sb = await ort.InferenceSession.create(buildB(dir), opts)
console.log(`${cpus()[0]?.model ?? '?'} × ${cpus().length}, load ${loadAverage(2)}, R = ${R}, ${WARMUP} warm-up + ${STEPS} steps per context, threads ${THREADS}`)
console.log('| context | A ms (median) | B ms (median, run + merge) | B / A (medians) | A ms (mean) | B ms (mean, merges included) | B / A (means) | merges (ms each) | max abs diff of the 8-layer output |')
console.log('|---|---|---|---|---|---|---|---|---|')
for (const ctx of CONTEXTS) {
  const row = await measure(sa, sb, ctx)
  const mergeEach = row.merges > 0 ? (row.merge / row.merges).toFixed(3) : '-'
  console.log(`| ${ctx} | ${row.aMed.toFixed(3)} | ${row.bMed.toFixed(3)} | ${(row.bMed / row.aMed).toFixed(2)} | ${row.aMean.toFixed(3)} | ${row.bMean.toFixed(3)} | ${(row.bMean / row.aMean).toFixed(2)} | ${row.merges} (${mergeEach}) | ${row.maxDiff.toExponential(2)} |`)
}
await sa.release()
await sb.release()
rmSync(dir, { recursive: true, force: true })
console.log(`load at end ${loadAverage(2)}`)
