/**
 * Where one engine step's time goes, op by op (issue 11; docs/engine-notes.md, waves 38–39): the
 * one-position graph of a single-stage shard (decode.onnx, which the engine runs for decode steps;
 * the stage graph where the shard has none), with shoal's kernels swapped in where the manifest
 * takes them (as a node loads it), run as a one-position step of B rows at context C (past buffers
 * as wide as the engine's block for it) with onnxruntime's profiler on; prints the step's mean time
 * and each op type's total a run, largest first. On a stage graph an If's total includes the nodes
 * of its branches, so the two overlap.
 *
 *   node reproduction/profile-ops.ts SHARD_DIR [--rows 8] [--context 192] [--runs 30] [--threads 2]
 * Run it as the other benchmarks (`chrt -r 10 node …`, nothing else on the machine); the profiler
 * itself adds a little to every op. Read shoal's kernels' rows (DecodeAttention, MatMulQ4) as upper
 * bounds: each call's malloc of its scratch took 30–150 µs in this process (wave 39, timed inside
 * the kernel; more with the profiler on) against ~2 µs in a serving daemon's engine worker, so at
 * eight rows they read up to ~2 ms a step more than they cost when serving.
 */
import { readdir, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import { sessionOptions } from '../daemon/engine/backend/onnxruntime.ts'
import { blockCapacity } from '../daemon/engine/kv-block.ts'
import { f32KernelFits } from '../daemon/engine/native/build.ts'
import { f32ProductsExact } from '../daemon/engine/native/f32-check.ts'
import { greedyHeadExact } from '../daemon/engine/native/head-check.ts'
import { loadKernelLibrary } from '../daemon/engine/native/load.ts'
import { LOGITS_WANTED, swapKernels } from '../daemon/engine/native/swap.ts'
import { ATTENTION_MASK, GREEDY_TOKEN, INPUT_IDS, NEW_KV, NUM_LOGITS_TO_KEEP, POSITION_IDS, pastKeyName, pastValueName } from '../shards/contract.ts'
import { loadManifest } from '../shards/index.ts'
import { gitDescribe, loadAverage, lscpuModel } from './lib/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'
import { nodeKernels } from './lib/native-kernels.ts'

// The session runs in this process: with `shoal serve`'s malloc settings, as served.
execWithServeMalloc()

const { values: args, positionals } = parseArgs({
  allowPositionals: true,
  options: { rows: { type: 'string', default: '8' }, context: { type: 'string', default: '192' }, runs: { type: 'string', default: '30' }, threads: { type: 'string', default: '2' } },
})
const dir = positionals[0]
if (dir === undefined) throw new Error('usage: node reproduction/profile-ops.ts SHARD_DIR [--rows 8] [--context 192] [--runs 30]')
const [B, C, RUNS] = [Number(args.rows), Number(args.context), Number(args.runs)]
const m = await loadManifest(dir)
const stage = m.stages[0]!
if (m.stages.length !== 1 || !stage.hasEmbedding || !stage.hasHead) throw new Error(`${dir}: a single-stage shard is needed`)
// The one-position graph where the shard has one: what the engine runs for a decode step.
const graph = join(dir, ...(stage.decodeGraph ?? stage.graph).split('/'))
const lib = await nodeKernels(m)
const base = sessionOptions({ threads: Number(args.threads) })
const extra = base.extra as { session: Record<string, unknown> }
const prefix = join(tmpdir(), `shoal-profile-ops-${process.pid}`)
let bytes: Uint8Array | undefined
let head = 0
if (lib.kernels !== undefined) {
  loadKernelLibrary(lib.kernels)
  // The head as a node serves it (the backend swaps it where its self-check passes): a greedy step's token on GreedyHead.
  const swapped = swapKernels(await readFile(graph), { head: await greedyHeadExact(lib.kernels), f32: await f32KernelFits() && await f32ProductsExact(lib.kernels) })
  bytes = swapped.bytes
  head = swapped.head
}
const options = { ...base, enableProfiling: true, profileFilePrefix: prefix, extra: { ...extra, session: { ...extra.session, model_external_initializers_file_folder_path: dirname(graph) } } }
const session = bytes === undefined ? await ort.InferenceSession.create(graph, options) : await ort.InferenceSession.create(bytes, options)

const { numLayers, numKvHeads: kvH, headDim: hd, maxPositions } = m.shape
const W = blockCapacity(C + 1, maxPositions)
const feeds: Record<string, ort.Tensor> = {
  [INPUT_IDS]: new ort.Tensor('int64', BigInt64Array.from({ length: B }, (_, i) => BigInt(5 + i)), [B, 1]),
  [POSITION_IDS]: new ort.Tensor('int64', new BigInt64Array(B).fill(BigInt(C)), [B, 1]),
  [ATTENTION_MASK]: new ort.Tensor('int64', new BigInt64Array(B * (C + 1)).fill(1n), [B, C + 1]),
}
if (session.inputNames.includes(NUM_LOGITS_TO_KEEP)) feeds[NUM_LOGITS_TO_KEEP] = new ort.Tensor('int64', BigInt64Array.of(1n), [])
// The step fetches the greedy token alone, as a greedy step of the engine does: no head product.
if (head > 0) feeds[LOGITS_WANTED] = new ort.Tensor('bool', [false], [])
let seed = 12345
const next = (): number => { seed = (Math.imul(seed, 1103515245) + 12345) >>> 0; return ((seed >>> 8) / 16777216 - 0.5) * 0.2 }
for (let l = 0; l < numLayers; l++) {
  for (const name of [pastKeyName(l), pastValueName(l)]) feeds[name] = new ort.Tensor('float32', Float32Array.from({ length: B * kvH * W * hd }, next), [B, kvH, W, hd])
}
const fetches = [GREEDY_TOKEN, NEW_KV].filter(n => session.outputNames.includes(n))
const loadBefore = loadAverage()
for (let i = 0; i < 10; i++) await session.run(feeds, fetches)
const began = performance.now()
for (let i = 0; i < RUNS; i++) await session.run(feeds, fetches)
const stepMs = (performance.now() - began) / RUNS
session.endProfiling()
const file = (await readdir(tmpdir())).find(f => f.startsWith(`shoal-profile-ops-${process.pid}`))
if (file === undefined) throw new Error('onnxruntime wrote no profile')
const events = JSON.parse(await readFile(join(tmpdir(), file), 'utf8')) as Array<{ cat: string, name: string, dur: number, args?: { op_name?: string } }>
await rm(join(tmpdir(), file), { force: true })
const runs = events.filter(e => e.cat === 'Session' && e.name === 'model_run').length
const byOp = new Map<string, number>()
for (const e of events) {
  if (e.cat !== 'Node' || !e.name.endsWith('_kernel_time')) continue
  const op = e.args?.op_name ?? '?'
  byOp.set(op, (byOp.get(op) ?? 0) + e.dur)
}
console.log(`# ${m.modelId}: one-position step, ${B} rows, context ${C}, ${args.threads} intra-op threads, shoal's kernels ${lib.kernels === undefined ? 'off' : 'on'}`)
console.log(`- command: node reproduction/profile-ops.ts ${process.argv.slice(2).join(' ')}`)
console.log(`- machine: ${lscpuModel()}; Node ${process.version}; git ${gitDescribe(join(import.meta.dirname, '..'))}; load ${loadBefore} → ${loadAverage()}`)
console.log(`- step: ${stepMs.toFixed(2)} ms a run with the profiler on (${RUNS} runs after 10; the profile counts ${runs} runs)\n`)
console.log('| op | ms a run |\n|---|---:|')
for (const [op, us] of [...byOp].sort((a, b) => b[1] - a[1])) if (us / runs >= 10) console.log(`| ${op} | ${(us / runs / 1000).toFixed(3)} |`)
