/**
 * Compressed activations between pipeline stages: tok/s of a 2-stage chain (real libp2p nodes on
 * loopback, one process) whose incoming links are capped at 10 / 100 / 1000 Mbit/s (simulated:
 * daemon/pipeline/delay.ts queues each received frame for bytes · 8 / bandwidth), for f32, f16 and
 * int8 activation frames; TTFT (prefill crosses the link as one frame per 256-position chunk),
 * decode tok/s, bytes per decoded token on the wire, and greedy token agreement with f32 over
 * whole sequences. Each bandwidth runs the three encodings back to back, interleaved over rounds.
 * The pipeline shards paper's figures (FP32 13.57, FP16 12.71, INT8 15.10 tok/s over a slow link;
 * ids instead of logits 3.97 → 22.12, which shoal's chains already do) are printed for shape.
 *
 * Run: node reproduction/bench-activations.ts [--size 60m] [--mbps 10,100,1000] [--tokens 64]
 *        [--prompt 192] [--rounds 2] [--latency 0]
 * The model is generated and compiled once into .cache/bench/.
 *
 * With --simulated-width W (e.g. 3072, Phi-3.5-mini's hidden size) the stages run a SIMULATED
 * engine instead — no weights: a fixed --simulated-ms per decode step per stage (prefill: that
 * plus --simulated-prefill-ms per position), returning Gaussian hidden states of width W — so
 * the wire's share of a token is measured at a real model's width on a machine too loaded or too
 * small to run one. Everything else (libp2p, frames, encoding, the capped link) is the real code.
 * Its tokens do not depend on the activations, so it measures time only, not agreement.
 */
import { existsSync } from 'node:fs'
import { cpus } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import type { Libp2p } from '@libp2p/interface'
import { createChainTokenSource, createPipelineStage, createStageNode, encodedBytes } from '../daemon/pipeline/index.ts'
import type { ActivationEncoding, ChainHop, PipelineStage, StageNode } from '../daemon/pipeline/index.ts'
import type { StageEngine, StageInfo, StepOutput } from '../daemon/engine/index.ts'
import { Prng } from '../shards/testmodel/prng.ts'
import { compileShards, generateTestModel } from '../shards/index.ts'
import type { ShardManifest, TestModelSize } from '../shards/index.ts'
import { loadAverage, median } from './lib/index.ts'
import { linkComponents, loopbackNode } from './lib/loopback.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: '60m' },
    mbps: { type: 'string', default: '10,100,1000' },
    tokens: { type: 'string', default: '64' },
    prompt: { type: 'string', default: '192' },
    rounds: { type: 'string', default: '2' },
    latency: { type: 'string', default: '0' },
    'simulated-width': { type: 'string' },
    'simulated-ms': { type: 'string', default: '20' },
    'simulated-prefill-ms': { type: 'string', default: '0.5' },
  },
})
const TOKENS = Number(args.tokens)
const ROUNDS = Number(args.rounds)
const LATENCY = Number(args.latency)
const ENCODINGS: ActivationEncoding[] = ['f32', 'f16', 'int8']
const PAPER = 'paper (pipeline shards, slow link): FP32 13.57, FP16 12.71, INT8 15.10 tok/s; top-1 ids instead of logits 3.97 → 22.12 tok/s'
const prompt = Array.from({ length: Number(args.prompt) }, (_, i) => 3 + (i * 131) % 500)

async function prepare (): Promise<{ dir: string, manifest: ShardManifest }> {
  const root = resolve(import.meta.dirname, '..', '.cache', 'bench', `activations-${args.size}`)
  const dir = join(root, 'two')
  if (!existsSync(join(dir, 'manifest.json'))) {
    await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: args.size as TestModelSize, seed: 4 })
    await compileShards({ modelDir: join(root, 'ckpt'), outDir: dir, stages: 2, modelId: 'bench' })
  }
  const { loadManifest } = await import('../shards/index.ts')
  return { dir, manifest: await loadManifest(dir) }
}

const book = new Map<string, Libp2p>()
async function host (dir: string, layers: [number, number], mbps: number): Promise<{ libp2p: Libp2p, stage: PipelineStage }> {
  const libp2p = await loopbackNode()
  book.set(libp2p.peerId.toString(), libp2p)
  const components = linkComponents(libp2p, book)
  const stage = await createPipelineStage({ shardDir: dir, layers, threads: 1, bandwidthMbps: mbps, delayMs: LATENCY }, components)
  await stage.start()
  return { libp2p, stage }
}

interface Run { ttftMs: number, tokS: number, tokens: number[], bytesPerToken: number }

async function run (hosts: Array<{ stage: { node: StageNode } }>, chain: ChainHop[], encoding: ActivationEncoding, id: string): Promise<Run> {
  const coord = hosts[0]!.stage.node
  const src = createChainTokenSource({ node: coord, requestId: id, sampling: { temperature: 0, topP: 1 }, deadline: Date.now() + 600_000, formChain: () => chain, activations: encoding })
  const signal = AbortSignal.timeout(600_000)
  try {
    const t0 = performance.now()
    const tokens = [await src.prefill(prompt, signal)]
    const t1 = performance.now()
    const b0 = coord.stats().bytesSent
    while (tokens.length < TOKENS) tokens.push(await src.decode(tokens.at(-1)!, prompt.length + tokens.length - 1, signal))
    const t2 = performance.now()
    return { ttftMs: t1 - t0, tokS: (tokens.length - 1) * 1000 / (t2 - t1), tokens, bytesPerToken: (coord.stats().bytesSent - b0) / (tokens.length - 1) }
  } finally {
    await src.close()
  }
}

function agreement (a: number[], b: number[]): string {
  let prefix = 0
  while (prefix < a.length && a[prefix] === b[prefix]) prefix++
  const same = a.filter((t, i) => t === b[i]).length
  return prefix === a.length ? `${a.length}/${a.length} identical` : `${same}/${a.length} same position, first ${prefix} identical`
}

/** SIMULATED stage engine: fixed time per step, Gaussian hidden states, a deterministic token at the end. */
function simulatedEngine (stage: StageInfo, msDecode: number, msPerPosition: number): StageEngine {
  const rng = new Prng(stage.layers[0] + 1)
  const noise = Float32Array.from({ length: 65536 }, () => rng.normal())
  let open = 0
  return {
    stage,
    async start () {},
    async stop () {},
    async open (seqId) { open++; return seqId ?? `s${open}` },
    async free () { open-- },
    async stats () { return { liveSequences: Math.max(0, open), kvBytes: 0 } as Awaited<ReturnType<StageEngine['stats']>> },
    async step (_seq, input, positions): Promise<StepOutput> {
      const rows = positions.length
      await sleep(msDecode + (rows > 1 ? rows * msPerPosition : 0))
      if (stage.hasHead) return { kind: 'token', id: (positions.at(-1)! * 7 + ('tokenIds' in input ? input.tokenIds.length : 0)) % 500 }
      const data = new Float32Array(rows * stage.hiddenSize)
      const off = (positions[0]! * 977) % 32768
      for (let i = 0; i < data.length; i++) data[i] = noise[(off + i) % 65536]!
      return { kind: 'hidden', data, count: rows, hidden: stage.hiddenSize }
    },
  }
}

async function simulated (width: number): Promise<void> {
  const ms = Number(args['simulated-ms'])
  const perPos = Number(args['simulated-prefill-ms'])
  process.stdout.write(`# SIMULATED engine: 2 stages, hidden ${width}, ${ms} ms per decode step per stage, prefill ${ms} ms + ${perPos} ms/position; prompt ${prompt.length}, ${TOKENS} tokens, +${LATENCY} ms/hop, ${ROUNDS} rounds (median)\n`)
  process.stdout.write(`# ${cpus().length} × ${cpus()[0]?.model ?? '?'}, load ${loadAverage(2)}, ${new Date().toISOString()}\n# ${PAPER}\n\n`)
  process.stdout.write('| link | encoding | TTFT ms | decode tok/s | × f32 | wire bytes / token |\n|---|---|---:|---:|---:|---:|\n')
  const info = (i: number): StageInfo => ({ hasEmbedding: i === 0, hasHead: i === 1, layers: i === 0 ? [0, 15] : [16, 31], hiddenSize: width, numKvHeads: 8, headDim: 128, vocabSize: 32064, maxPositions: 131072 } as StageInfo)
  for (const mbps of args.mbps.split(',').map(Number)) {
    const hosts: Array<{ libp2p: Libp2p, stage: { node: StageNode } }> = []
    for (let i = 0; i < 2; i++) {
      const libp2p = await loopbackNode()
      book.set(libp2p.peerId.toString(), libp2p)
      const node = createStageNode({ engine: simulatedEngine(info(i), ms, perPos), modelId: 'sim', manifestHash: 'sim', bandwidthMbps: mbps, delayMs: LATENCY }, linkComponents(libp2p, book))
      await node.start()
      hosts.push({ libp2p, stage: { node } })
    }
    const chain: ChainHop[] = hosts.map((h, i) => ({ peerId: h.libp2p.peerId.toString(), layers: info(i).layers }))
    await run(hosts, chain, 'f32', `warm-${mbps}`)
    const runs = new Map<ActivationEncoding, Run[]>(ENCODINGS.map(e => [e, []]))
    for (let r = 0; r < ROUNDS; r++) for (const e of ENCODINGS) runs.get(e)!.push(await run(hosts, chain, e, `${mbps}-${e}-${r}`))
    const f32 = median(runs.get('f32')!.map(x => x.tokS))
    for (const e of ENCODINGS) {
      const rs = runs.get(e)!
      const tokS = median(rs.map(x => x.tokS))
      process.stdout.write(`| ${mbps} Mbit/s | ${e} | ${median(rs.map(x => x.ttftMs)).toFixed(0)} | ${tokS.toFixed(1)} | ${(tokS / f32).toFixed(2)} | ${median(rs.map(x => x.bytesPerToken)).toFixed(0)} |\n`)
    }
    for (const h of hosts) { await h.stage.node.stop(); await h.libp2p.stop() }
  }
}

async function main (): Promise<void> {
  if (args['simulated-width'] !== undefined) { await simulated(Number(args['simulated-width'])); return }
  const { dir, manifest } = await prepare()
  const width = manifest.shape.hiddenSize
  const [s0, s1] = manifest.stages
  process.stdout.write(`# 2-stage chain, ${args.size} (hidden ${width}, ${manifest.shape.numLayers} layers), prompt ${prompt.length}, ${TOKENS} tokens, +${LATENCY} ms/hop, ${ROUNDS} rounds (median)\n`)
  process.stdout.write(`# ${cpus().length} × ${cpus()[0]?.model ?? '?'}, load ${loadAverage(2)}, ${new Date().toISOString()}\n# ${PAPER}\n\n`)
  process.stdout.write('| link | encoding | TTFT ms | decode tok/s | × f32 | wire bytes / token | greedy tokens vs f32 |\n|---|---|---:|---:|---:|---:|---|\n')
  const fp32Tokens: number[][] = []
  for (const mbps of args.mbps.split(',').map(Number)) {
    const hosts = [await host(dir, s0!.layers, mbps), await host(dir, s1!.layers, mbps)]
    const chain: ChainHop[] = hosts.map((h, i) => ({ peerId: h.libp2p.peerId.toString(), layers: manifest.stages[i]!.layers }))
    await run(hosts, chain, 'f32', `warm-${mbps}`)
    const runs = new Map<ActivationEncoding, Run[]>(ENCODINGS.map(e => [e, []]))
    for (let r = 0; r < ROUNDS; r++) for (const e of ENCODINGS) runs.get(e)!.push(await run(hosts, chain, e, `${mbps}-${e}-${r}`))
    const f32 = runs.get('f32')!
    fp32Tokens.push(f32[0]!.tokens)
    for (const e of ENCODINGS) {
      const rs = runs.get(e)!
      const tokS = median(rs.map(x => x.tokS))
      const agree = e === 'f32'
        ? (fp32Tokens.every(t => t.join() === f32[0]!.tokens.join()) && rs.every(x => x.tokens.join() === f32[0]!.tokens.join()) ? 'exact (the reference)' : 'f32 runs DIFFER')
        : agreement(rs[0]!.tokens, f32[0]!.tokens)
      process.stdout.write(`| ${mbps} Mbit/s | ${e} | ${median(rs.map(x => x.ttftMs)).toFixed(0)} | ${tokS.toFixed(1)} | ${(tokS / median(f32.map(x => x.tokS))).toFixed(2)} | ${median(rs.map(x => x.bytesPerToken)).toFixed(0)} | ${agree} |\n`)
    }
    for (const h of hosts) { await h.stage.stop(); await h.libp2p.stop() }
  }
  // What one decode step's activation costs on the wire at the papers' widths (per hop, payload only).
  process.stdout.write('\n| hidden | f32 bytes | f16 | int8 | ms per hop at 10 / 100 / 1000 Mbit/s (f32 → int8) |\n|---:|---:|---:|---:|---|\n')
  for (const w of [width, 3072, 4096, 8192]) {
    const b = ENCODINGS.map(e => encodedBytes(e, 1, w))
    const ms = [10, 100, 1000].map(m => `${(b[0]! * 8 / (m * 1000)).toFixed(2)} → ${(b[2]! * 8 / (m * 1000)).toFixed(2)}`)
    process.stdout.write(`| ${w} | ${b[0]} | ${b[1]} | ${b[2]} | ${ms.join(' / ')} |\n`)
  }
}

await main()
process.exit(0)
