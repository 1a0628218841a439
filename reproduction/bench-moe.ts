/**
 * The per-step cost of one mixture-of-experts block (router + routed experts), three ways, on
 * onnxruntime-node CPU with the engine backend's session options:
 *   grouped   the 'standard' op table: each chosen expert runs once over the rows routed to it
 *   all-rows  the ungrouped baseline: every expert over every row, masked by the routing weights
 *   contrib   the 'ort-contrib' op table (fp32): onnxruntime's fused com.microsoft MoE
 * for N rows per call (decode batch sizes and a prefill chunk), random weights, fixed inputs.
 * And the paper's dense-layer trick: a dense SwiGLU of width S × I run as one MLP ('dense') vs
 * as S all-active slices of width I summed with unit weights ('slices'; same result).
 * The three graphs alternate call by call so machine noise hits them alike; reported: median wall
 * time and median process CPU time per call.
 *
 * Run: node reproduction/bench-moe.ts [--hidden 1024] [--experts 16] [--top-k 2] [--width 512]
 *      [--rows 1,8,64] [--reps 40] [--threads N] [--dense-slices 8]
 * This script builds one block through the graph builder's internals (shards/graph), since a
 * whole model would time attention too.
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { availableParallelism, tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import type { MoeWeights, ModelSpec } from '../shards/architectures.ts'
import { makeSwiGlu, transpose } from '../shards/graph/blocks.ts'
import { DT, GraphBuilder } from '../shards/graph/builder.ts'
import { allRowsExperts, contribExperts, groupedExperts } from '../shards/graph/moe.ts'
import { OP_TABLES } from '../shards/graph/ops.ts'
import type { BuildContext, OpTable } from '../shards/graph/types.ts'
import { hash32, Prng } from '../shards/testmodel/prng.ts'
import { upperMedian } from './lib/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values } = parseArgs({
  options: {
    hidden: { type: 'string', default: '1024' },
    experts: { type: 'string', default: '16' },
    'top-k': { type: 'string', default: '2' },
    width: { type: 'string', default: '512' },
    rows: { type: 'string', default: '1,8,64' },
    reps: { type: 'string', default: '40' },
    threads: { type: 'string' },
    'dense-slices': { type: 'string', default: '8' },
  },
})
const D = Number(values.hidden)
const E = Number(values.experts)
const K = Number(values['top-k'])
const I = Number(values.width)
const ROWS = values.rows.split(',').map(Number)
const REPS = Number(values.reps)
const THREADS = values.threads !== undefined ? Number(values.threads) : availableParallelism()
/** Dense FFN of width SLICES × I, as one SwiGLU vs as SLICES all-active expert slices with unit weights. */
const SLICES = Number(values['dense-slices'])

const rand = (name: string, n: number, scale: number): Float32Array => {
  const rng = new Prng(hash32(name))
  return Float32Array.from({ length: n }, () => scale * rng.normal())
}
const weights: MoeWeights = {
  router: { shape: [E, D], data: rand('router', E * D, 1 / Math.sqrt(D)) },
  experts: Array.from({ length: E }, (_, e) => ({
    gateUp: { shape: [2 * I, D], data: rand(`gu${e}`, 2 * I * D, 1 / Math.sqrt(D)) },
    down: { shape: [D, I], data: rand(`d${e}`, D * I, 1 / Math.sqrt(I)) },
  })),
}
const spec = {
  shape: { hiddenSize: D, moe: { numExperts: E, topK: K, expertIntermediateSize: I, normTopK: true, sharedExpertIntermediateSize: 0, moeLayers: [0] } },
} as unknown as ModelSpec

// The dense FFN's slices: slice s is rows s·I..(s+1)·I of gate and up, columns of down.
const sliceWeights = Array.from({ length: SLICES }, (_, s) => ({
  gateUp: { shape: [2 * I, D], data: rand(`dgu${s}`, 2 * I * D, 1 / Math.sqrt(D)) },
  down: { shape: [D, I], data: rand(`dd${s}`, D * I, 1 / Math.sqrt(I * SLICES)) },
}))
function denseWhole (): { gateUp: { shape: number[], data: Float32Array }, down: { shape: number[], data: Float32Array } } {
  const W = SLICES * I
  const gateUp = new Float32Array(2 * W * D)
  const down = new Float32Array(D * W)
  sliceWeights.forEach((sw, s) => {
    gateUp.set(sw.gateUp.data.subarray(0, I * D), s * I * D) // gate rows
    gateUp.set(sw.gateUp.data.subarray(I * D), (W + s * I) * D) // up rows
    for (let d = 0; d < D; d++) down.set(sw.down.data.subarray(d * I, (d + 1) * I), d * W + s * I)
  })
  return { gateUp: { shape: [2 * W, D], data: gateUp }, down: { shape: [D, W], data: down } }
}

type Body = (ctx: BuildContext, x: string) => string
const moeBody = (experts: OpTable['experts']): Body => (ctx, x) => {
  const logits = ctx.g.op('MatMul', '/moe/router/MatMul', [x, ctx.g.f32Weight('router', [D, E], transpose(weights.router))])
  return experts(ctx, '/moe', 'moe', x, logits, weights)
}
const denseBody: Body = (ctx, x) => makeSwiGlu(ctx, '/mlp', 'mlp', x, denseWhole(), SLICES * I)
const slicesBody: Body = (ctx, x) => {
  let acc: string | undefined
  sliceWeights.forEach((sw, s) => {
    const y = makeSwiGlu(ctx, `/mlp/slices.${s}`, `mlp.slices.${s}`, x, sw, I)
    acc = acc === undefined ? y : ctx.g.op('Add', `/mlp/slices.${s}/Add`, [acc, y])
  })
  return acc!
}

async function build (dir: string, name: string, body: Body): Promise<ort.InferenceSession> {
  const g = new GraphBuilder(`${name}.data`)
  const ctx: BuildContext = { g, spec, ops: OP_TABLES.standard, quant: { kind: 'none' }, accuracyLevel: 0 }
  const x = g.input('x', DT.FLOAT, ['rows', D])
  g.output('y', body(ctx, x), DT.FLOAT, ['rows', D])
  await writeFile(join(dir, `${name}.onnx`), g.encode(name, ''))
  await writeFile(join(dir, `${name}.data`), Buffer.concat(g.data()))
  return await ort.InferenceSession.create(join(dir, `${name}.onnx`), {
    graphOptimizationLevel: 'all', intraOpNumThreads: THREADS, interOpNumThreads: 1,
    extra: { session: { intra_op: { allow_spinning: '0' } } },
  })
}

const cpuMs = (): number => { const u = process.cpuUsage(); return (u.user + u.system) / 1000 }

const dir = await mkdtemp(join(tmpdir(), 'shoal-bench-moe-'))
try {
  await bench('MoE block', { grouped: moeBody(groupedExperts), 'all-rows': moeBody(allRowsExperts), contrib: moeBody(contribExperts) },
    `hidden ${D}, ${E} experts of width ${I}, top-${K}`)
  if (SLICES > 1) {
    await bench('Dense FFN', { dense: denseBody, slices: slicesBody }, `hidden ${D}, width ${SLICES * I} as one SwiGLU vs ${SLICES} all-active slices of ${I}`)
  }
} finally {
  await rm(dir, { recursive: true, force: true })
}

async function bench (title: string, variants: Record<string, Body>, what: string): Promise<void> {
  const sessions = Object.fromEntries(await Promise.all(Object.entries(variants).map(async ([k, f]) => [k, await build(dir, k, f)] as const)))
  const first = Object.keys(sessions)[0]!
  console.log(`\n${title}: ${what}; ${THREADS} intra-op threads; ${REPS} reps`)
  console.log(`| rows | variant | wall ms (median) | CPU ms (median) | max |y − ${first}| |`)
  console.log('|---:|---|---:|---:|---:|')
  for (const N of ROWS) {
    const x = new ort.Tensor('float32', rand(`x${N}`, N * D, 1), [N, D])
    const wall: Record<string, number[]> = {}
    const cpu: Record<string, number[]> = {}
    const out: Record<string, Float32Array> = {}
    for (const k of Object.keys(sessions)) { wall[k] = []; cpu[k] = []; out[k] = (await sessions[k]!.run({ x })).y!.data as Float32Array }
    for (let r = 0; r < REPS; r++) {
      for (const [k, s] of Object.entries(sessions)) {
        const c0 = cpuMs()
        const t0 = performance.now()
        await s.run({ x })
        wall[k]!.push(performance.now() - t0)
        cpu[k]!.push(cpuMs() - c0)
      }
    }
    for (const k of Object.keys(sessions)) {
      let err = 0
      out[k]!.forEach((v, i) => { err = Math.max(err, Math.abs(v - out[first]![i]!)) })
      console.log(`| ${N} | ${k} | ${upperMedian(wall[k]!).toFixed(3)} | ${upperMedian(cpu[k]!).toFixed(3)} | ${err.toExponential(1)} |`)
    }
  }
  for (const s of Object.values(sessions)) await s.release()
}
