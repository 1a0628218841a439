/**
 * Experts on holder processes vs the same model whole on one node. A random-weight MoE checkpoint
 * (default qwen3-moe 'small': hidden 256, 6 layers, layer 0 dense, 8 experts of width 176, top-2)
 * is compiled twice: one-graph shards (the baseline, run in this process) and expert-parallel
 * shards. For each holder count H, H holder processes (reproduction/expert-holder-process.ts,
 * each under `taskset -c` its own core when --pin and enough cores) keep the experts placed by
 * placeExperts; this process is the stage (attention, router, combine) over libp2p TCP loopback.
 *
 * Per configuration and batch size B (B streams decoded together, greedy): aggregate decode
 * tok/s (B × (N − 1) tokens / decode wall time), prefill time (≈ TTFT), payload bytes on the wire
 * per decode token, and whether every stream's tokens equal the baseline's.
 *
 *   node reproduction/bench-experts.ts [--arch qwen3-moe] [--size small] [--holders 1,2,4]
 *        [--streams 1,4,16] [--tokens 32] [--pin] [--threads 1]
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process'
import { existsSync } from 'node:fs'
import { availableParallelism, loadavg } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { createInterface } from 'node:readline'
import { parseArgs } from 'node:util'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { tcp } from '@libp2p/tcp'
import { multiaddr } from '@multiformats/multiaddr'
import { createLibp2p } from 'libp2p'
import ort from 'onnxruntime-node'
import { createExpertLinks, createExpertParallelRunner, expertBytes, placeExperts, type ExpertLink } from '../daemon/experts/index.ts'
import {
  ATTENTION_MASK, compileExpertShards, compileShards, generateTestModel, INPUT_IDS, LOGITS, NUM_LOGITS_TO_KEEP,
  pastKeyName, pastValueName, POSITION_IDS, presentKeyName, presentValueName, type MoeTestArchitecture, type ShardManifest, type TestModelSize,
} from '../shards/index.ts'
import { raggedPromptIds } from './lib/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values } = parseArgs({
  options: {
    arch: { type: 'string', default: 'qwen3-moe' },
    size: { type: 'string', default: 'small' },
    holders: { type: 'string', default: '1,2,4' },
    streams: { type: 'string', default: '1,4,16' },
    tokens: { type: 'string', default: '32' },
    pin: { type: 'boolean', default: false },
    threads: { type: 'string', default: '1' },
    cache: { type: 'string', default: '.cache/bench-experts' },
  },
})
const ARCH = values.arch as MoeTestArchitecture
const SIZE = values.size as TestModelSize
const HOLDERS = values.holders.split(',').map(Number)
const STREAMS = values.streams.split(',').map(Number)
const N = Number(values.tokens)
const THREADS = Number(values.threads)
const CACHE = resolve(values.cache)
const MODEL = 'bench-experts'
const cores = availableParallelism()
const canPin = values.pin && spawnSync('taskset', ['-c', '0', 'true']).status === 0

const ckpt = join(CACHE, `${ARCH}-${SIZE}`)
if (!existsSync(join(ckpt, 'config.json'))) await generateTestModel({ architecture: ARCH, size: SIZE, outDir: ckpt, seed: 4 })
const whole = await compileShards({ modelDir: ckpt, outDir: join(CACHE, `${ARCH}-${SIZE}-whole`) })
const expertDir = join(CACHE, `${ARCH}-${SIZE}-experts`)
const layout = await compileExpertShards({ modelDir: ckpt, outDir: expertDir })
const V = whole.shape.vocabSize

const i64 = (v: number[], dims: number[]): ort.Tensor => new ort.Tensor('int64', BigInt64Array.from(v.map(BigInt)), dims)
const argmaxRows = (logits: Float32Array, B: number): number[] => Array.from({ length: B }, (_, b) => { let best = 0; for (let j = 1; j < V; j++) if (logits[b * V + j]! > logits[b * V + best]!) best = j; return best })

/** The baseline: one-graph shards, batched greedy with left padding. */
async function baseline (m: ShardManifest, prompts: number[][]): Promise<{ tokens: number[][], prefillMs: number, decodeMs: number }> {
  const s = await ort.InferenceSession.create(join(CACHE, `${ARCH}-${SIZE}-whole`, m.stages[0]!.graph), { intraOpNumThreads: THREADS, interOpNumThreads: 1 })
  const B = prompts.length
  const S = Math.max(...prompts.map(p => p.length))
  const pad = prompts.map(p => S - p.length)
  const feeds: Record<string, ort.Tensor> = {}
  for (let l = 0; l < m.shape.numLayers; l++) {
    feeds[pastKeyName(l)] = new ort.Tensor('float32', new Float32Array(0), [B, m.shape.numKvHeads, 0, m.shape.headDim])
    feeds[pastValueName(l)] = new ort.Tensor('float32', new Float32Array(0), [B, m.shape.numKvHeads, 0, m.shape.headDim])
  }
  let mask = prompts.flatMap((_, b) => Array.from({ length: S }, (_, j) => (j < pad[b]! ? 0 : 1)))
  const t0 = performance.now()
  let out = await s.run({ ...feeds, [INPUT_IDS]: i64(prompts.flatMap((p, b) => [...new Array<number>(pad[b]!).fill(0), ...p]), [B, S]), [POSITION_IDS]: i64(prompts.flatMap((_, b) => Array.from({ length: S }, (_, j) => Math.max(0, j - pad[b]!))), [B, S]), [ATTENTION_MASK]: i64(mask, [B, S]), [NUM_LOGITS_TO_KEEP]: i64([1], []) })
  const t1 = performance.now()
  const tokens: number[][] = prompts.map(() => [])
  for (let i = 0; i < N; i++) {
    const next = argmaxRows(out[LOGITS]!.data as Float32Array, B)
    next.forEach((t, b) => tokens[b]!.push(t))
    if (i + 1 === N) break
    for (let l = 0; l < m.shape.numLayers; l++) { feeds[pastKeyName(l)] = out[presentKeyName(l)]!; feeds[pastValueName(l)] = out[presentValueName(l)]! }
    const cols = mask.length / B
    mask = prompts.flatMap((_, b) => [...mask.slice(b * cols, (b + 1) * cols), 1])
    out = await s.run({ ...feeds, [INPUT_IDS]: i64(next, [B, 1]), [POSITION_IDS]: i64(prompts.map(p => p.length + i), [B, 1]), [ATTENTION_MASK]: i64(mask, [B, mask.length / B]), [NUM_LOGITS_TO_KEEP]: i64([1], []) })
  }
  const t2 = performance.now()
  await s.release()
  return { tokens, prefillMs: t1 - t0, decodeMs: t2 - t1 }
}

async function spawnHolder (experts: Array<{ layer: number, expert: number }>, core: number | undefined): Promise<{ child: ChildProcess, peerId: string, addrs: string[] }> {
  const args = [join(import.meta.dirname, 'expert-holder-process.ts'), '--dir', expertDir, '--model', MODEL, '--threads', String(THREADS), '--experts', experts.map(e => `${e.layer}:${e.expert}`).join(',')]
  const child = core === undefined ? spawn(process.execPath, args, { stdio: ['pipe', 'pipe', 'inherit'] }) : spawn('taskset', ['-c', String(core), process.execPath, ...args], { stdio: ['pipe', 'pipe', 'inherit'] })
  const line = await new Promise<string>((resolve, reject) => {
    createInterface({ input: child.stdout! }).once('line', resolve)
    child.once('exit', (code) => reject(new Error(`holder exited with ${code}`)))
  })
  return { child, ...(JSON.parse(line) as { peerId: string, addrs: string[] }) }
}

console.log(`${ARCH} ${SIZE}: ${layout.shape.numLayers} layers, MoE layers ${layout.shape.moe!.moeLayers.join(',')}, ${layout.shape.moe!.numExperts} experts of width ${layout.shape.moe!.expertIntermediateSize}, top-${layout.shape.moe!.topK}; ${N} tokens; ${THREADS} intra-op thread(s) per process; ${cores} cores, load ${loadavg()[0]!.toFixed(1)}; pinning ${canPin ? 'on' : 'off'}`)
console.log('| experts on | streams | decode tok/s (aggregate) | prefill ms | wire bytes / token | tokens = whole |')
console.log('|---|---:|---:|---:|---:|---|')
const want = new Map<number, number[][]>()
for (const B of STREAMS) {
  const prompts = Array.from({ length: B }, (_, b) => raggedPromptIds(b))
  const r = await baseline(whole, prompts)
  want.set(B, r.tokens)
  console.log(`| whole model, this process | ${B} | ${(B * (N - 1) / (r.decodeMs / 1000)).toFixed(1)} | ${r.prefillMs.toFixed(1)} | 0 | — |`)
}
for (const H of HOLDERS) {
  const moe = layout.shape.moe!
  const bytes = expertBytes(layout.shape, layout.quantization)
  const d = placeExperts({ moeLayers: moe.moeLayers, numExperts: moe.numExperts, expertBytes: bytes, nodes: Array.from({ length: H }, (_, i) => ({ peerId: `h${i}`, freeBytes: 1e12 })), maxReplicas: 1 })
  if (d.kind !== 'plan') throw new Error(d.reason)
  const holders = await Promise.all(d.plan.nodes.map(async (n, i) => await spawnHolder(
    d.plan.layers.flatMap(l => l.holders.flatMap((hs, expert) => hs.includes(n.peerId) ? [{ layer: l.layer, expert }] : [])),
    canPin && cores > H ? 1 + i : undefined)))
  const byLabel = new Map(d.plan.nodes.map((n, i) => [n.peerId, holders[i]!]))
  const stage = await createLibp2p({ transports: [tcp()], connectionEncrypters: [noise()], streamMuxers: [yamux()], connectionMonitor: { enabled: false } })
  const links = createExpertLinks({
    handle: async () => {},
    openStream: async (label, protocol, signal) => await stage.dialProtocol(byLabel.get(label)!.addrs.map(a => multiaddr(a)), protocol, { signal }),
  })
  const link: ExpertLink = links.link
  const runner = createExpertParallelRunner({ dir: expertDir, layout, plan: d.plan, model: MODEL, link, threads: THREADS, stepTimeoutMs: 60_000 })
  await runner.open()
  try {
    for (const B of STREAMS) {
      const prompts = Array.from({ length: B }, (_, b) => raggedPromptIds(b))
      const t0 = performance.now()
      let t1 = 0
      const r = await runner.greedy(prompts, N, (i) => { if (i === 0) t1 = performance.now() })
      const t2 = performance.now()
      const same = JSON.stringify(r.tokens) === JSON.stringify(want.get(B))
      console.log(`| ${H} holder process${H > 1 ? 'es' : ''} | ${B} | ${(B * (N - 1) / ((t2 - t1) / 1000)).toFixed(1)} | ${(t1 - t0).toFixed(1)} | ${(r.decodeBytes / B).toFixed(0)} | ${same ? 'yes' : 'NO'} |`)
    }
  } finally {
    await runner.close()
    links.stop()
    await stage.stop()
    for (const h of holders) h.child.kill('SIGTERM')
  }
}
