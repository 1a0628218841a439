/**
 * KV mobility with real parts: two (or three) libp2p nodes on loopback, each running the local
 * service over a real onnxruntime worker with the tiny generated fp32 model. Node A serves turn 1
 * of a conversation and keeps its prompt's KV; node B gets turn 2 with a `prefixHolder` hint naming
 * A, pulls the prefix over /shoal/kv/1.0.0 and generates token for token what a cold run gives,
 * prefilling only the new tokens. A corrupted transfer (a malicious holder flipping one byte of a
 * chunk) is detected and recomputed, still identical; a peer that is not admitted, or that asks
 * for another model's prefix, is refused.
 */
import type { Libp2p } from '@libp2p/interface'
import { Registry } from 'prom-client'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService } from '../../daemon/engine/index.ts'
import { parseToWorker } from '../../daemon/engine/protocol.ts'
import type { LocalService, LocalServiceInit } from '../../daemon/engine/index.ts'
import {
  createFrameSplitter, createKvPuller, decodePayload, encodeFrame, exactPrefixHashes, KV_PROTOCOL, KvRefusedError, prefixScope, serveKv, transferFrames,
} from '../../daemon/kv/index.ts'
import type { KvPuller, KvStore, KvTransportComponents } from '../../daemon/kv/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { buildTinyModel, randomTokenIds } from '../engine/tiny-model.ts'
import type { TinyModel } from '../engine/tiny-model.ts'
import { createTestNode } from '../routing/nodes.ts'
import { linkComponents } from '../../reproduction/lib/loopback.ts'

const BLOCK = 8
let counter = 0
function request (model: TinyModel, ids: number[], over: Partial<GenerateRequest> = {}): GenerateRequest {
  return {
    requestId: `mv-${++counter}`,
    model: model.manifest.modelId,
    prompt: { kind: 'tokens', ids },
    maxTokens: 12,
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    deadline: Date.now() + 60_000,
    ...over,
  }
}

interface Run { tokens: number[], start: Extract<GenerateEvent, { type: 'start' }> }
async function run (svc: LocalService, req: GenerateRequest): Promise<Run> {
  const tokens: number[] = []
  let start: Run['start'] | undefined
  for await (const ev of svc.generate(req, new AbortController().signal)) {
    if (ev.type === 'start') start = ev
    if (ev.type === 'delta') tokens.push(...ev.tokenIds)
  }
  return { tokens, start: start! }
}

/** Nodes by peer id, so any test node can dial any other by id (no discovery here). */
const book = new Map<string, Libp2p>()
const componentsOf = (node: Libp2p): KvTransportComponents => linkComponents(node, book)

interface Host { node: Libp2p, peerId: string, service: LocalService, registry: Registry, puller: KvPuller }

describe('KV mobility between two nodes', () => {
  let model: TinyModel
  let vocab: number
  let cold: LocalService
  let a: Host
  let b: Host
  const stops: Array<() => Promise<void>> = []
  /** Peers node A lets pull (stands in for the mesh's admitted set). */
  const admitted = new Set<string>()

  async function host (init: Partial<LocalServiceInit> = {}): Promise<Host> {
    const node = await createTestNode()
    const peerId = node.peerId.toString()
    book.set(peerId, node)
    const registry = new Registry()
    const components = componentsOf(node)
    let service: LocalService | undefined
    const puller = createKvPuller({ blockSize: BLOCK, maxChunkBytes: 4096 }, { openStream: components.openStream, store: (m) => m === model.manifest.modelId ? service?.kvStore : undefined })
    service = createLocalService({
      shardDir: model.shardDir,
      threads: 1,
      maxSequences: 2,
      prefixBlockSize: BLOCK,
      metrics: registry,
      nodeId: peerId,
      pullPrefix: async (args) => await puller.pull({ ...args, model: model.manifest.modelId }),
      // The tiny model prefills faster than any link moves its KV: make every hinted pull happen.
      pullPolicy: () => true,
      ...init,
    })
    await service.start()
    const server = await serveKv({ stores: () => [service!.kvStore!], authorize: from => admitted.has(from) ? undefined : new Error('not admitted') }, components)
    stops.push(async () => { await server.stop(); await service!.stop(); await node.stop() })
    return { node, peerId, service, registry, puller }
  }

  beforeAll(async () => {
    model = await buildTinyModel()
    vocab = model.manifest.shape.vocabSize
    cold = createLocalService({ shardDir: model.shardDir, threads: 1, kvCacheBytes: 0 })
    await cold.start()
    a = await host()
    b = await host()
    admitted.add(b.peerId)
  }, 120_000)
  afterAll(async () => {
    for (const stop of stops.reverse()) await stop().catch(() => {})
    await cold?.stop()
    await model?.cleanup()
  })

  const metric = async (h: Host, name: string, labels: string): Promise<number> => {
    const line = (await h.registry.metrics()).split('\n').find(l => l.startsWith(`${name}{`) && l.includes(labels))
    return line === undefined ? 0 : Number(line.split(' ').pop())
  }

  it('B pulls the prefix A kept and generates turn 2 exactly as a cold run, prefilling only the new tokens', async () => {
    const turn1 = randomTokenIds(45, 1, vocab)
    const first = await run(a.service, request(model, turn1))
    expect(first.tokens).toEqual((await run(cold, request(model, turn1))).tokens)
    const turn2 = [...turn1, ...first.tokens, ...randomTokenIds(9, 2, vocab)]
    const want = await run(cold, request(model, turn2))

    const before = (await b.service.stats()).prefix!
    const got = await run(b.service, request(model, turn2, { prefixHolder: { peerId: a.peerId, cachedTokens: turn1.length } }))
    expect(got.tokens).toEqual(want.tokens)
    const after = (await b.service.stats()).prefix!
    // A kept turn 1's prompt (45 positions): all of it came over the wire, only the rest ran.
    expect(after.hitTokens - before.hitTokens).toBe(turn1.length)
    expect(after.missTokens - before.missTokens).toBe(turn2.length - turn1.length)
    expect(got.start.prefix).toEqual({ peerId: b.peerId, reusedTokens: turn1.length, movedFrom: a.peerId })
    const bytes = 45 * 2 * 4 * 2 * 16 * 4 // positions × (k, v) × layers × kv heads × head dim × f32
    expect(await metric(b, 'shoal_kv_pulls_total', 'outcome="ok"')).toBe(1)
    expect(await metric(b, 'shoal_kv_transfer_bytes_total', 'direction="in"')).toBe(bytes)
    expect(await metric(a, 'shoal_kv_transfer_bytes_total', 'direction="out"')).toBe(bytes)

    // Turn 3 on B is a plain local hit now, not another pull.
    const turn3 = [...turn2, ...got.tokens, ...randomTokenIds(5, 3, vocab)]
    const third = await run(b.service, request(model, turn3, { prefixHolder: { peerId: a.peerId, cachedTokens: turn1.length } }))
    expect(third.tokens).toEqual((await run(cold, request(model, turn3))).tokens)
    // Its own kept turn 2 prompt (not moved: no movedFrom).
    expect(third.start.prefix).toEqual({ peerId: b.peerId, reusedTokens: turn2.length })
    expect(await metric(b, 'shoal_kv_pulls_total', 'outcome="ok"')).toBe(1)
  }, 120_000)

  it('a corrupted transfer (one byte of one chunk flipped by a malicious holder) is detected and recomputed, still identical', async () => {
    // The malicious holder serves A's real KV, with one byte of its third chunk flipped.
    const evil = await createTestNode()
    const evilId = evil.peerId.toString()
    book.set(evilId, evil)
    stops.push(async () => { await evil.stop() })
    let served = 0
    await evil.handle(KV_PROTOCOL, async (stream) => {
      const split = createFrameSplitter()
      const pull = await new Promise<ReturnType<typeof decodePayload>>((resolve) => {
        stream.addEventListener('message', (evt) => {
          for (const p of split.push(evt.data instanceof Uint8Array ? evt.data : evt.data.subarray())) resolve(decodePayload(p))
        })
      })
      if (pull.kind !== 'pull') throw new Error('expected a pull')
      const store: KvStore = a.service.kvStore!
      const info = store.info()
      const exported = (await store.exportPrefix(pull.tokens, AbortSignal.timeout(10_000)))!
      const scope = prefixScope({ manifestHash: info.manifestHash, layers: [info.layers[0], info.layers[1]], dtype: info.dtype })
      let i = 0
      for (const f of transferFrames({
        requestId: pull.requestId, ...info, tokens: exported.tokens, blockSize: pull.blockSize, tensors: exported.layers, maxChunkBytes: pull.maxChunkBytes,
        hashes: exactPrefixHashes(scope, pull.tokens.slice(0, exported.tokens), pull.blockSize),
      })) {
        const bytes = encodeFrame(f)
        if (i++ === 3) bytes[bytes.length - 9]! ^= 0x10
        if (stream.writeStatus !== 'writable') break
        stream.send(bytes)
      }
      served++
      await stream.close().catch(() => {})
    })

    const turn1 = randomTokenIds(40, 11, vocab)
    const first = await run(a.service, request(model, turn1))
    const turn2 = [...turn1, ...first.tokens, ...randomTokenIds(7, 12, vocab)]
    const want = await run(cold, request(model, turn2))
    const direct = await b.puller.pull({ peerId: evilId, model: model.manifest.modelId, tokens: turn2, signal: AbortSignal.timeout(10_000) })
    expect(direct).toMatchObject({ ok: false, code: 'SHOAL_ERR_KV_CHECKSUM' })

    const before = (await b.service.stats()).prefix!
    const fallbacks = await metric(b, 'shoal_kv_pulls_total', 'outcome="fallback"')
    const got = await run(b.service, request(model, turn2, { prefixHolder: { peerId: evilId, cachedTokens: turn1.length } }))
    expect(served).toBe(2)
    expect(got.tokens).toEqual(want.tokens)
    expect(got.start.prefix).toBeUndefined()
    const after = (await b.service.stats()).prefix!
    // Nothing of the bad transfer was used: the whole prompt was prefilled.
    expect(after.hitTokens - before.hitTokens).toBe(0)
    expect(after.missTokens - before.missTokens).toBe(turn2.length)
    expect(await metric(b, 'shoal_kv_pulls_total', 'outcome="fallback"')).toBe(fallbacks + 1)
  }, 120_000)

  it('refuses a peer that is not admitted, and a pull for another model; the request still runs, recomputed', async () => {
    const turn1 = randomTokenIds(32, 21, vocab)
    await run(a.service, request(model, turn1))
    const turn2 = [...turn1, ...randomTokenIds(6, 22, vocab)]
    const want = await run(cold, request(model, turn2))

    // C is not in A's admitted set.
    const c = await host()
    const refused = await c.puller.pull({ peerId: a.peerId, model: model.manifest.modelId, tokens: turn2, signal: AbortSignal.timeout(10_000) })
    expect(refused).toMatchObject({ ok: false, code: 'SHOAL_ERR_KV_REFUSED' })
    const got = await run(c.service, request(model, turn2, { prefixHolder: { peerId: a.peerId, cachedTokens: turn1.length } }))
    expect(got.tokens).toEqual(want.tokens)
    expect((await c.service.stats()).prefix).toMatchObject({ hitTokens: 0, missTokens: turn2.length })

    // D serves the same weights under another manifest hash: its KV scope differs, A refuses.
    const d = await host({ manifestHash: 'another-manifest' })
    admitted.add(d.peerId)
    const other = await d.puller.pull({ peerId: a.peerId, model: model.manifest.modelId, tokens: turn2, signal: AbortSignal.timeout(10_000) })
    expect(other).toMatchObject({ ok: false, code: 'SHOAL_ERR_KV_WRONG_MODEL' })
    // A model this node does not serve is refused before any stream opens.
    expect(await d.puller.pull({ peerId: a.peerId, model: 'nope', tokens: turn2, signal: AbortSignal.timeout(10_000) })).toMatchObject({ ok: false })
    // And a prompt A keeps nothing of.
    const none = await b.puller.pull({ peerId: a.peerId, model: model.manifest.modelId, tokens: randomTokenIds(30, 99, vocab), signal: AbortSignal.timeout(10_000) })
    expect(none).toMatchObject({ ok: false, code: 'SHOAL_ERR_KV_NOT_HELD' })
    expect(new KvRefusedError('SHOAL_ERR_KV_NOT_HELD', 'x').name).toBe('KvRefusedError')
    // Whatever fails on the way to a pull (here the policy itself), the request runs, recomputed.
    const e = await host({ pullPolicy: () => { throw new Error('boom') } })
    admitted.add(e.peerId)
    expect((await run(e.service, request(model, turn2, { prefixHolder: { peerId: a.peerId, cachedTokens: turn1.length } }))).tokens).toEqual(want.tokens)
  }, 120_000)
})

describe('export-prefix and import-prefix at the engine worker', () => {
  let model: TinyModel
  let svc: LocalService
  beforeAll(async () => {
    model = await buildTinyModel()
    svc = createLocalService({ shardDir: model.shardDir, threads: 1, prefixBlockSize: BLOCK })
    await svc.start()
  }, 120_000)
  afterAll(async () => {
    await svc?.stop()
    await model?.cleanup()
  })

  it('checks the messages, and refuses KV of the wrong count, shape or with non-finite values', async () => {
    expect(parseToWorker({ type: 'export-prefix', id: 1, key: 'k', length: 3 })).toMatchObject({ type: 'export-prefix' })
    expect(parseToWorker({ type: 'export-prefix', id: 1, key: 'k', length: 0 })).toMatch(/length/)
    expect(parseToWorker({ type: 'import-prefix', id: 2, key: 'k', length: 3, layers: [new Float32Array(1)] })).toMatchObject({ type: 'import-prefix' })
    expect(parseToWorker({ type: 'import-prefix', id: 2, key: 'k', length: 3, layers: [[1, 2]] })).toMatch(/Float32Array/)
    const e = svc.engine!
    const stage = e.stage
    const layers = stage.layers[1] - stage.layers[0] + 1
    const size = (n: number): number => stage.numKvHeads * n * stage.headDim
    await expect(e.exportPrefix('nothing', 4)).rejects.toMatchObject({ code: 'SHOAL_ERR_ENGINE' })
    await expect(e.importPrefix('x1', 4, Array.from({ length: 2 * layers - 1 }, () => new Float32Array(size(4))))).rejects.toThrow(/tensors/)
    await expect(e.importPrefix('x2', 4, Array.from({ length: 2 * layers }, () => new Float32Array(size(3))))).rejects.toThrow(/values/)
    const nan = Array.from({ length: 2 * layers }, () => new Float32Array(size(4)))
    nan[3]![7] = Number.NaN
    await expect(e.importPrefix('x3', 4, nan)).rejects.toThrow(/non-finite/)
    // A good one round-trips exactly, and is kept under its key.
    const good = Array.from({ length: 2 * layers }, (_, i) => Float32Array.from({ length: size(4) }, (_, j) => i + j / 100))
    const want = good.map(t => t.slice())
    await expect(e.importPrefix('x4', 4, good)).resolves.toEqual({ length: 4, bytes: 2 * layers * size(4) * 4 })
    expect(await e.exportPrefix('x4', 3)).toEqual(want.map(t => {
      // The first 3 positions of each [kvHeads, 4, headDim] tensor.
      const out = new Float32Array(size(3))
      for (let h = 0; h < stage.numKvHeads; h++) out.set(t.subarray(h * 4 * stage.headDim, (h * 4 + 3) * stage.headDim), h * 3 * stage.headDim)
      return out
    }))
    await e.evict(['x4'])
    expect((await e.stats()).keptPrefixes).toBe(0)
  })
})
