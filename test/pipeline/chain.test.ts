/**
 * Pipeline chains over real libp2p nodes on loopback, each stage with its own StageEngine:
 * 2- and 3-stage chains give exactly the unsplit model's tokens (greedy and seeded sampling) over
 * whole 64-token sequences for several concurrent requests, and leave no KV or streams behind.
 */
import { Registry } from 'prom-client'
import type { Histogram } from 'prom-client'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createChainTokenSource } from '../../daemon/pipeline/index.ts'
import type { StageEngine } from '../../daemon/engine/index.ts'
import type { SamplingParams } from '../../daemon/service.ts'
import { buildModels, chainFrom, eventually, holderOf, referenceTokens, runSource, startStage, startWholeEngine, stopHost } from './fixture.ts'
import type { Models, StageHost } from './fixture.ts'

const N = 64
const prompts = [
  [1, 17, 300, 42, 42, 9, 250, 11],
  [1, 5],
  [1, 400, 3, 77, 150, 12, 8, 99, 61, 200, 201, 202, 7, 7, 7, 31, 18, 490, 2, 64],
]
const greedy: SamplingParams = { temperature: 0, topP: 1 }

let models: Models
let whole: StageEngine
const want = new Map<string, number[]>()

beforeAll(async () => {
  models = await buildModels()
  whole = await startWholeEngine(models)
  for (const [i, p] of prompts.entries()) want.set(`g${i}`, await referenceTokens(whole, p, N))
  want.set('s0', await referenceTokens(whole, prompts[0]!, N, { temperature: 0.9, topP: 0.95, seed: 1234 }))
  // The reference is not degenerate (random weights could loop on one token).
  expect(new Set(want.get('g0')).size).toBeGreaterThan(8)
}, 120_000)

afterAll(async () => {
  await whole?.stop()
  await models?.cleanup()
})

async function clean (hosts: StageHost[]): Promise<void> {
  for (const h of hosts) {
    const s = await eventually(() => h.stage.node.engine.stats(), v => v.liveSequences === 0)
    expect(s.liveSequences).toBe(0)
    expect(s.kvBytes).toBe(0)
    const n = await eventually(() => h.stage.node.stats(), v => v.served === 0 && v.watched === 0)
    expect(n).toMatchObject({ served: 0, watched: 0 })
  }
}

describe.each([
  { name: '2-stage', stages: 2 },
  { name: '3-stage', stages: 3 },
])('$name chain', ({ stages }) => {
  let hosts: StageHost[]
  /** Each stage's batcher metrics (batch sizes). */
  let registries: Registry[]

  beforeAll(async () => {
    const dir = stages === 2 ? models.two : models.three
    const L = models.manifest.shape.numLayers
    const ranges: Array<[number, number]> = stages === 2
      ? [[0, L / 2 - 1], [L / 2, L - 1]]
      : [[0, L / 2 - 1], [L / 2, L - 2], [L - 1, L - 1]]
    hosts = []
    registries = ranges.map(() => new Registry())
    for (const [i, r] of ranges.entries()) hosts.push(await startStage(dir, r, { metrics: registries[i]! }))
  }, 60_000)
  afterAll(async () => { for (const h of hosts ?? []) await stopHost(h) })

  it('gives the unsplit model\'s greedy tokens for concurrent requests, and frees everything', async () => {
    const [coord, ...rest] = hosts
    const form = chainFrom(coord!, () => rest.map(h => holderOf(h)))
    const signal = AbortSignal.timeout(60_000)
    const runs = prompts.map(async (p, i) => {
      const src = createChainTokenSource({ node: coord!.stage.node, requestId: `req-${stages}-${i}`, sampling: greedy, deadline: Date.now() + 60_000, formChain: form })
      try {
        const got = await runSource(src, p, N, signal)
        expect(src.route).toEqual(hosts.map(h => h.peerId))
        return got
      } finally {
        await src.close()
      }
    })
    const got = await Promise.all(runs)
    for (const [i, g] of got.entries()) expect(g).toEqual(want.get(`g${i}`))
    // Each stage's batcher keeps the requests in one wave per stage: no run takes more than
    // ⌈requests / stages⌉ sequences (batching them all would march them through the chain in
    // lockstep), and where that allows more than one, steps of different requests did share runs
    // (the coordinator's own stage-0 steps included).
    const cap = Math.ceil(prompts.length / stages)
    for (const registry of registries) {
      const sizes = (await (registry.getSingleMetric('shoal_batch_size') as Histogram).get()).values
      const count = sizes.find(v => v.metricName === 'shoal_batch_size_count')?.value ?? 0
      const sum = sizes.find(v => v.metricName === 'shoal_batch_size_sum')?.value ?? 0
      const withinCap = sizes.find(v => v.metricName === 'shoal_batch_size_bucket' && v.labels.le === cap)?.value
      expect(count).toBeGreaterThan(0)
      expect(withinCap).toBe(count)
      if (cap > 1) expect(sum).toBeGreaterThan(count)
    }
    await clean(hosts)
    // one long-lived stream per neighbour pair (plus the ring's way back), however many requests
    expect(coord!.stage.node.stats().streams).toBe(stages === 2 ? 1 : 2)
  }, 120_000)

  it('samples at the last stage exactly as the unsplit model does (seeded)', async () => {
    const [coord, ...rest] = hosts
    const sampling: SamplingParams = { temperature: 0.9, topP: 0.95, seed: 1234 }
    const src = createChainTokenSource({ node: coord!.stage.node, requestId: `samp-${stages}`, sampling, deadline: Date.now() + 60_000, formChain: chainFrom(coord!, () => rest.map(h => holderOf(h))) })
    try {
      expect(await runSource(src, prompts[0]!, N, AbortSignal.timeout(60_000))).toEqual(want.get('s0'))
    } finally {
      await src.close()
    }
    await clean(hosts)
  }, 120_000)
})
