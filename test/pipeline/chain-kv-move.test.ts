/**
 * KV mobility on a rebuilt chain (issue 16: "for a chain, each stage pulls its own layers"), with
 * real parts: libp2p stage nodes on loopback, each over a real onnxruntime worker with the tiny
 * fp32 model split in two. Turn 1 of a conversation runs on chain A→B and every stage keeps its
 * layers' KV under the coordinator's key. Then B stops taking new chains (it drops out of the
 * holders the coordinator forms chains from — draining, suspected — but still runs and serves its
 * kept KV), so turn 2 forms A→B': B' pulls its layers' part of the prefix from B over /shoal/kv
 * (pull-kept) before the rest of the prompt runs, and the tokens equal a cold run's, prefilling
 * only the new tokens. A refused and a corrupted transfer fall back to recomputing the whole
 * prompt on the rebuilt chain, with the same tokens. Concurrent follow-ups share one pull. The
 * coordinator's load-reply summary lists what its chains keep, as routing reads an entry point.
 */
import type { Stream } from '@libp2p/interface'
import { Registry } from 'prom-client'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService } from '../../daemon/engine/index.ts'
import type { LocalService } from '../../daemon/engine/index.ts'
import { blockHashes, cachedTokensFor, kvBytesPerToken, prefixScope, serveKv } from '../../daemon/kv/index.ts'
import type { KvStore, PullCostInput } from '../../daemon/kv/index.ts'
import { createPipelineService } from '../../daemon/pipeline/index.ts'
import type { PipelineService } from '../../daemon/pipeline/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { buildModels, chainRequest, componentsOf, eventually, holderOf, startStage, stopHost } from './fixture.ts'
import type { Models, StageHost } from './fixture.ts'

const MIB = 1024 * 1024

let models: Models
let cold: LocalService
let counter = 0
/** Stage 0 and coordinator; B kept turn 1's layers; B' serves them on the rebuilt chain. */
let a: StageHost
let b: StageHost
let b2: StageHost
let service: PipelineService
const registries = { a: new Registry(), b: new Registry(), b2: new Registry() }
/** The stage-1 holders chains are formed from now. */
let holders: StageHost[] = []
/** How B's /shoal/kv answers: serves, refuses the puller, or flips one byte of a chunk on the way. */
let mode: 'serve' | 'refuse' | 'corrupt' = 'serve'
/** Every pull B' weighed (its cost model's input). */
const weighed: PullCostInput[] = []
let kvStop: Array<() => Promise<void>> = []
/** Bits B's /shoal/kv flipped on the way out (corrupt mode). */
let flipped = 0

const request = (ids: number[], maxTokens = 16): GenerateRequest => chainRequest(`ckm-${++counter}`, ids, maxTokens)

interface Run { tokens: number[], start: Extract<GenerateEvent, { type: 'start' }> }

async function run (svc: { generate: LocalService['generate'] }, req: GenerateRequest): Promise<Run> {
  const tokens: number[] = []
  let start: Run['start'] | undefined
  for await (const ev of svc.generate(req, new AbortController().signal)) {
    if (ev.type === 'start') start = ev
    if (ev.type === 'delta') tokens.push(...ev.tokenIds)
  }
  return { tokens, start: start! }
}

/** Deterministic pseudo-random token ids in [3, 512). */
function tokens (n: number, seed: number): number[] {
  let x = seed * 2654435761 >>> 0
  return Array.from({ length: n }, () => { x = (x * 1103515245 + 12345) >>> 0; return 3 + (x >>> 8) % 509 })
}

async function metric (registry: Registry, name: string, labels: string): Promise<number> {
  const line = (await registry.metrics()).split('\n').find(l => l.startsWith(`${name}{`) && l.includes(labels))
  return line === undefined ? 0 : Number(line.split(' ').pop())
}
const transferred = async (r: Registry, direction: 'in' | 'out'): Promise<number> => await metric(r, 'shoal_kv_transfer_bytes_total', `direction="${direction}"`)
const pulls = async (outcome: 'ok' | 'fallback'): Promise<number> => await metric(registries.b2, 'shoal_kv_pulls_total', `outcome="${outcome}"`)

/** Serves a host's kept prefixes over /shoal/kv (the daemon does this for every served stage). */
async function serveStageKv (h: StageHost, corruptible: boolean): Promise<void> {
  const c = componentsOf(h.libp2p)
  const server = await serveKv({
    stores: () => [h.stage.node.kvStore].filter((s): s is KvStore => s !== undefined),
    authorize: from => corruptible && mode === 'refuse' ? new Error(`${from} is refused by the test`) : undefined,
  }, {
    openStream: c.openStream,
    handle: async (protocol, handler) => {
      await c.handle(protocol, (stream: Stream, connection) => {
        if (corruptible && mode === 'corrupt') {
          // The third frame on the way out (a chunk of KV) gets one bit flipped inside its data.
          let i = 0
          const send = stream.send.bind(stream)
          stream.send = (data) => {
            const bytes = data instanceof Uint8Array ? data.slice() : data.slice()
            if (i++ === 2) { bytes[bytes.length - 9]! ^= 0x10; flipped++ }
            return send(bytes)
          }
        }
        return handler(stream, connection)
      })
    },
  })
  kvStop.push(server.stop)
}

beforeAll(async () => {
  models = await buildModels()
  cold = createLocalService({ shardDir: models.whole, threads: 1, kvCacheBytes: 0 })
  await cold.start()
  const L = models.manifest.shape.numLayers
  a = await startStage(models.two, [0, L / 2 - 1], { kvCacheBytes: 64 * MIB, metrics: registries.a })
  b = await startStage(models.two, [L / 2, L - 1], { kvCacheBytes: 64 * MIB, metrics: registries.b })
  // The cost model is unit-tested (test/kv/pull-plan.test.ts); here every pull it is asked about is made, and recorded.
  b2 = await startStage(models.two, [L / 2, L - 1], { kvCacheBytes: 64 * MIB, metrics: registries.b2, pullPolicy: c => { weighed.push(c); return true } })
  await serveStageKv(b, true)
  await serveStageKv(b2, false)
  service = createPipelineService({ stage: a.stage, shardDir: models.two, prefixBlockSize: 8, metrics: registries.a }, { holders: () => holders.map(h => holderOf(h)) })
  await service.start()
}, 120_000)

afterAll(async () => {
  await service?.stop()
  for (const s of kvStop) await s().catch(() => {})
  kvStop = []
  for (const h of [a, b, b2]) if (h !== undefined) await stopHost(h)
  await cold?.stop()
  await models?.cleanup()
})

/** Prompt positions a request prefilled, and those it took from a kept prefix. */
async function counted<T> (f: () => Promise<T>): Promise<{ value: T, miss: number, hit: number }> {
  const before = service.stats().prefix!
  const value = await f()
  const after = service.stats().prefix!
  return { value, miss: after.missTokens - before.missTokens, hit: after.hitTokens - before.hitTokens }
}

/** Turn 1 of a conversation on A→B, every stage keeping it; then B stops taking new chains. */
async function turnOneOnB (seed: number): Promise<{ turn1: number[], turn2: number[] }> {
  holders = [b]
  const turn1 = tokens(40, seed)
  const first = await run(service, request(turn1))
  expect(first.start.route).toEqual([a.peerId, b.peerId])
  // B keeps its layers once the finish reached it (after the coordinator's request ended): its
  // sequence ends kept.
  await eventually(() => b.stage.node.stats().served, n => n === 0)
  expect(await eventually(() => b.stage.node.engine.stats(), s => s.liveSequences === 0)).toMatchObject({ liveSequences: 0 })
  holders = [b2]
  return { turn1, turn2: [...turn1, ...first.tokens, ...tokens(7, seed + 100)] }
}

describe('a rebuilt chain\'s stage pulls its layers\' KV from the stage that kept them', () => {
  it('B\' pulls turn 1\'s prefix from B; turn 2 equals a cold run and prefills only the new tokens', async () => {
    mode = 'serve'
    const { turn1, turn2 } = await turnOneOnB(1)
    // The coordinator's load-reply summary says its chains keep turn 1, in the model's whole scope
    // (routing's view of an entry point): the follow-up's history is found there.
    const summary = service.prefixSummary!(64)!
    expect(summary.scope).toBe(prefixScope({ manifestHash: a.stage.manifestHash, layers: [0, models.manifest.shape.numLayers - 1], dtype: 'float32' }))
    expect(cachedTokensFor(blockHashes(summary.scope, turn2, summary.blockSize), new Set(summary.hashes), summary.blockSize))
      .toBe(Math.floor(turn1.length / summary.blockSize) * summary.blockSize)
    const want = await run(cold, request(turn2))
    const inBefore = await transferred(registries.b2, 'in')
    const outBefore = await transferred(registries.b, 'out')
    const okBefore = await pulls('ok')
    const weighedBefore = weighed.length

    const turn = await counted(() => run(service, request(turn2)))
    expect(turn.value.start.route).toEqual([a.peerId, b2.peerId])
    expect(turn.value.tokens).toEqual(want.tokens)
    expect(new Set(want.tokens).size).toBeGreaterThan(3)
    expect(turn.value.start.prefix?.reusedTokens).toBe(turn1.length)
    // The start event (and so the receipt and x-shoal-prefix-moved-from) names where the layers came from.
    expect(turn.value.start.prefix?.movedFrom).toBe(b.peerId)
    expect(turn.hit).toBe(turn1.length)
    expect(turn.miss).toBe(turn2.length - turn1.length)

    // B' weighed one pull of the whole kept prefix of its layers, made it, and took the bytes.
    expect(weighed.length).toBe(weighedBefore + 1)
    const info = b2.stage.node.kvStore!.info()
    expect(info.layers).toEqual(b.stage.served().layers)
    expect(weighed.at(-1)).toMatchObject({ tokens: turn1.length, bytesPerToken: kvBytesPerToken(info) })
    expect(await pulls('ok')).toBe(okBefore + 1)
    const bytes = turn1.length * kvBytesPerToken(info)
    expect(await transferred(registries.b2, 'in')).toBe(inBefore + bytes)
    expect(await transferred(registries.b, 'out')).toBe(outBefore + bytes)

    // Turn 3 stays on the rebuilt chain, which kept turn 2 itself: an ordinary local reuse, no pull.
    const turn3 = [...turn2, ...turn.value.tokens, ...tokens(5, 300)]
    await eventually(() => b2.stage.node.stats().served, n => n === 0)
    const third = await counted(() => run(service, request(turn3)))
    expect(third.value.tokens).toEqual((await run(cold, request(turn3))).tokens)
    expect(third.hit).toBe(turn2.length)
    expect(third.value.start.prefix).toMatchObject({ reusedTokens: turn2.length })
    expect(third.value.start.prefix?.movedFrom).toBeUndefined()
    expect(weighed.length).toBe(weighedBefore + 1)
  }, 180_000)

  it('concurrent follow-ups sharing the moved prefix make one pull between them, each with a cold run\'s tokens', async () => {
    mode = 'serve'
    const { turn1 } = await turnOneOnB(4)
    const prompts = [0, 1, 2].map(i => [...turn1, ...tokens(5 + i, 400 + i)])
    const want = await Promise.all(prompts.map(async p => (await run(cold, request(p))).tokens))
    const okBefore = await pulls('ok')
    const weighedBefore = weighed.length
    const got = await Promise.all(prompts.map(async p => await counted(() => run(service, request(p)))))
    for (const [i, r] of got.entries()) {
      expect(r.value.start.route).toEqual([a.peerId, b2.peerId])
      expect(r.value.start.prefix?.reusedTokens).toBe(turn1.length)
      expect(r.value.tokens).toEqual(want[i])
    }
    expect(weighed.length).toBe(weighedBefore + 1)
    expect(await pulls('ok')).toBe(okBefore + 1)
  }, 180_000)

  it.each([
    { name: 'refused by the holder', m: 'refuse' as const },
    { name: 'corrupted on the way (one bit of one chunk)', m: 'corrupt' as const },
  ])('a transfer $name is never used: the rebuilt chain recomputes the whole prompt, same tokens', async ({ m }) => {
    mode = 'serve'
    const { turn2 } = await turnOneOnB(m === 'refuse' ? 2 : 3)
    const want = await run(cold, request(turn2))
    const fallbackBefore = await pulls('fallback')
    const flippedBefore = flipped
    const inBefore = await transferred(registries.b2, 'in')
    mode = m
    try {
      const turn = await counted(() => run(service, request(turn2)))
      expect(turn.value.start.route).toEqual([a.peerId, b2.peerId])
      expect(turn.value.tokens).toEqual(want.tokens)
      expect(turn.value.start.prefix).toBeUndefined()
      expect(turn.hit).toBe(0)
      expect(turn.miss).toBe(turn2.length)
    } finally {
      mode = 'serve'
    }
    expect(await pulls('fallback')).toBe(fallbackBefore + 1)
    // The corrupted transfer did reach B' (and was refused there by its checksum).
    expect(flipped - flippedBefore).toBe(m === 'corrupt' ? 1 : 0)
    expect(await transferred(registries.b2, 'in')).toBe(inBefore)
    // Nothing is left running on any stage.
    for (const h of [a, b, b2]) expect(await eventually(() => h.stage.node.engine.stats(), s => s.liveSequences === 0)).toMatchObject({ liveSequences: 0 })
  }, 180_000)
})
