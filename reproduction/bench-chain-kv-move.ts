/**
 * KV mobility on a rebuilt chain: time to first token (TTFT) of a follow-up turn (a long history
 * plus a short new message) on a 2-stage chain whose stage 1 moved since turn 1 — three ways:
 *   local hit   turn 2 on the same chain A→B, every stage opening from what it kept;
 *   pulled      turn 2 on A→B' (B took no new chains): B' pulls its layers' part of the history
 *               from B over /shoal/kv (pull-kept), then the rest is prefilled;
 *   recomputed  turn 2 on A→B'' whose pull policy says no: B'' refuses the prefix, the chain is
 *               reopened and the whole prompt prefilled (what the cost model's "recompute" costs,
 *               one wasted open included).
 * Real stage nodes (libp2p on loopback, TCP + noise + yamux, onnxruntime workers), one thread
 * each. Every follow-up's greedy tokens are checked against the local hit's. The cost model's
 * verdict on B''s pull (shouldPull with B''s measured rates) is printed beside it.
 *
 *   node reproduction/bench-chain-kv-move.ts [--size 60m] [--quant int4] [--history 2000] [--new 20] [--rounds 1]
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { cpus, tmpdir } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import type { Libp2p } from '@libp2p/interface'
import { Registry } from 'prom-client'
import { pullCost, serveKv, shouldPull } from '../daemon/kv/index.ts'
import type { KvStore, PullCostInput } from '../daemon/kv/index.ts'
import { createPipelineService, createPipelineStage } from '../daemon/pipeline/index.ts'
import type { PipelineStage, PipelineStageInit } from '../daemon/pipeline/index.ts'
import type { GenerateRequest } from '../daemon/service.ts'
import { compileShards, generateTestModel } from '../shards/index.ts'
import type { TestModelSize } from '../shards/testmodel/generate.ts'
import { lcgTokens, loadAverage } from './lib/index.ts'
import { linkComponents, loopbackNode } from './lib/loopback.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: '60m' },
    quant: { type: 'string', default: 'int4' },
    history: { type: 'string', default: '2000' },
    new: { type: 'string', default: '20' },
    rounds: { type: 'string', default: '1' },
  },
})
const HISTORY = Number(args.history)
const NEW = Number(args.new)
const ROUNDS = Number(args.rounds)

const book = new Map<string, Libp2p>()
interface Host { libp2p: Libp2p, stage: PipelineStage, peerId: string, registry: Registry }

async function host (dir: string, layers: [number, number], extra: Partial<PipelineStageInit> = {}): Promise<Host> {
  const libp2p = await loopbackNode()
  book.set(libp2p.peerId.toString(), libp2p)
  const components = linkComponents(libp2p, book)
  const registry = new Registry()
  const stage = await createPipelineStage({ shardDir: dir, layers, threads: 1, kvCacheBytes: 512 * 1024 * 1024, metrics: registry, ...extra }, components)
  await stage.start()
  await serveKv({ stores: () => [stage.node.kvStore].filter((s): s is KvStore => s !== undefined) }, components)
  return { libp2p, stage, peerId: libp2p.peerId.toString(), registry }
}

async function main (): Promise<void> {
  const root = await mkdtemp(join(tmpdir(), 'shoal-bench-chain-kv-'))
  try {
    await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: args.size as TestModelSize })
    const manifest = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'two'), modelId: 'bench', quant: args.quant as 'none' | 'int4', stages: 2 })
    const L = manifest.shape.numLayers
    const dir = join(root, 'two')
    const a = await host(dir, [0, L / 2 - 1])
    const b = await host(dir, [L / 2, L - 1])
    const weighed: PullCostInput[] = []
    const b1 = await host(dir, [L / 2, L - 1], { pullPolicy: c => { weighed.push(c); return true } })
    const b2 = await host(dir, [L / 2, L - 1], { pullPolicy: c => { weighed.push(c); return false } })
    let holders: Host[] = [b]
    const service = createPipelineService({ stage: a.stage, shardDir: dir }, {
      holders: () => holders.map(h => { const s = h.stage.served(); return { peerId: h.peerId, modelId: s.id, manifestHash: s.manifestHash, layers: s.layers, admitted: true, alive: true, rttMs: 1 } }),
    })
    await service.start()
    let n = 0
    const run = async (ids: number[], maxTokens: number): Promise<{ ttftMs: number, tokens: number[], route: string[] }> => {
      const req: GenerateRequest = { requestId: `b-${++n}`, model: 'bench', prompt: { kind: 'tokens', ids }, maxTokens, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 600_000 }
      const began = performance.now()
      let ttftMs = 0
      let route: string[] = []
      const out: number[] = []
      for await (const ev of service.generate(req, new AbortController().signal)) {
        if (ev.type === 'start') route = ev.route
        if (ev.type === 'delta') { if (out.length === 0) ttftMs = performance.now() - began; out.push(...ev.tokenIds) }
      }
      return { ttftMs, tokens: out, route }
    }
    const settle = async (): Promise<void> => {
      for (let i = 0; i < 200; i++) {
        const idle = await Promise.all([a, b, b1, b2].map(async h => h.stage.node.stats().served === 0 && (await h.stage.node.engine.stats()).liveSequences === 0))
        if (idle.every(Boolean)) return
        await sleep(50)
      }
    }
    const short = (id: string): string => ({ [a.peerId]: 'A', [b.peerId]: 'B', [b1.peerId]: "B'", [b2.peerId]: "B''" })[id] ?? id
    console.log(`model ${args.size} ${args.quant}, ${L} layers in 2 stages; history ${HISTORY} + 8 reply + ${NEW} new tokens; load ${loadAverage()} on ${cpus().length} cores`)
    for (let r = 0; r < ROUNDS; r++) {
      holders = [b]
      const turn1 = lcgTokens(HISTORY, 10 + r)
      const first = await run(turn1, 8)
      await settle()
      const turn2 = [...turn1, ...first.tokens, ...lcgTokens(NEW, 100 + r)]
      holders = [b1]
      const pulled = await run(turn2, 8)
      await settle()
      const cost = weighed.at(-1)!
      const c = pullCost(cost)
      holders = [b2]
      const recomputed = await run(turn2, 8)
      await settle()
      holders = [b]
      const local = await run(turn2, 8)
      await settle()
      const bytes = Number((await b1.registry.metrics()).split('\n').find(l => l.startsWith('shoal_kv_transfer_bytes_total{') && l.includes('direction="in"'))?.split(' ').pop() ?? 0)
      console.log(JSON.stringify({
        round: r,
        routes: { pulled: pulled.route.map(short).join('→'), recomputed: recomputed.route.map(short).join('→'), local: local.route.map(short).join('→') },
        ttftMs: { local: Math.round(local.ttftMs), pulled: Math.round(pulled.ttftMs), recomputed: Math.round(recomputed.ttftMs) },
        movedBytes: bytes,
        costModel: { verdict: shouldPull(cost) ? 'pull' : 'recompute', transferMs: Math.round(c.transferMs), recomputeMs: Math.round(c.recomputeMs), prefillTokensPerSecond: Math.round(cost.prefillTokensPerSecond) },
        identical: { pulled: pulled.tokens.join() === local.tokens.join(), recomputed: recomputed.tokens.join() === local.tokens.join() },
      }))
    }
    await service.stop()
    for (const h of [a, b, b1, b2]) { await h.stage.stop(); await h.libp2p.stop() }
  } finally {
    await rm(root, { recursive: true, force: true })
  }
}

await main()
