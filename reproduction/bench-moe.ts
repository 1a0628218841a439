/**
 * The per-step cost of one mixture-of-experts block (router + routed experts), three ways, on
 * onnxruntime-node CPU with the engine backend's session options:
 *   grouped   the 'standard' op table: each chosen expert runs once over the rows routed to it
 *   all-rows  the ungrouped baseline: every expert over every row, masked by the routing weights
 *   contrib   the 'ort-contrib' op table (fp32): onnxruntime's fused com.microsoft MoE
 * for N rows per call (decode batch sizes and a prefill chunk), random weights, fixed inputs.
 * The three graphs alternate call by call so machine noise hits them alike; reported: median wall
 * time and median process CPU time per call.
 *
 * Run: node reproduction/bench-moe.ts [--hidden 1024] [--experts 16] [--top-k 2] [--width 512]
 *      [--rows 1,8,64] [--reps 40] [--threads N]
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
import { transpose } from '../shards/graph/blocks.ts'
import { DT, GraphBuilder } from '../shards/graph/builder.ts'
import { allRowsExperts, contribExperts, groupedExperts } from '../shards/graph/moe.ts'
import { OP_TABLES } from '../shards/graph/ops.ts'
import type { BuildContext, OpTable } from '../shards/graph/types.ts'
import { hash32, Prng } from '../shards/testmodel/prng.ts'

const { values } = parseArgs({
  options: {
    hidden: { type: 'string', default: '1024' },
    experts: { type: 'string', default: '16' },
    'top-k': { type: 'string', default: '2' },
    width: { type: 'string', default: '512' },
    rows: { type: 'string', default: '1,8,64' },
    reps: { type: 'string', default: '40' },
    threads: { type: 'string' },
  },
})
const D = Number(values.hidden)
const E = Number(values.experts)
const K = Number(values['top-k'])
const I = Number(values.width)
const ROWS = values.rows.split(',').map(Number)
const REPS = Number(values.reps)
const THREADS = values.threads !== undefined ? Number(values.threads) : availableParallelism()

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

async function build (dir: string, name: string, experts: OpTable['experts']): Promise<ort.InferenceSession> {
  const g = new GraphBuilder(`${name}.data`)
  const ctx: BuildContext = { g, spec, ops: OP_TABLES.standard, quant: { kind: 'none' }, accuracyLevel: 0 }
  const x = g.input('x', DT.FLOAT, ['rows', D])
  const logits = g.op('MatMul', '/moe/router/MatMul', [x, g.f32Weight('router', [D, E], transpose(weights.router))])
  g.output('y', experts(ctx, '/moe', 'moe', x, logits, weights), DT.FLOAT, ['rows', D])
  await writeFile(join(dir, `${name}.onnx`), g.encode(name, ''))
  await writeFile(join(dir, `${name}.data`), Buffer.concat(g.data()))
  return await ort.InferenceSession.create(join(dir, `${name}.onnx`), {
    graphOptimizationLevel: 'all', intraOpNumThreads: THREADS, interOpNumThreads: 1,
    extra: { session: { intra_op: { allow_spinning: '0' } } },
  })
}

const median = (v: number[]): number => { const s = [...v].sort((a, b) => a - b); return s[Math.floor(s.length / 2)]! }
const cpuMs = (): number => { const u = process.cpuUsage(); return (u.user + u.system) / 1000 }

const dir = await mkdtemp(join(tmpdir(), 'shoal-bench-moe-'))
try {
  const variants = { grouped: groupedExperts, 'all-rows': allRowsExperts, contrib: contribExperts }
  const sessions = Object.fromEntries(await Promise.all(Object.entries(variants).map(async ([k, f]) => [k, await build(dir, k, f)] as const)))
  console.log(`MoE block: hidden ${D}, ${E} experts of width ${I}, top-${K}; ${THREADS} intra-op threads; ${REPS} reps`)
  console.log('| rows | variant | wall ms (median) | CPU ms (median) | max |y − grouped| |')
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
      out[k]!.forEach((v, i) => { err = Math.max(err, Math.abs(v - out.grouped![i]!)) })
      console.log(`| ${N} | ${k} | ${median(wall[k]!).toFixed(3)} | ${median(cpu[k]!).toFixed(3)} | ${err.toExponential(1)} |`)
    }
  }
  for (const s of Object.values(sessions)) await s.release()
} finally {
  await rm(dir, { recursive: true, force: true })
}
