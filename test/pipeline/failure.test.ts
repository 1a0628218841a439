/**
 * Failure on real libp2p nodes: a stage killed mid-generation is replayed on another holder with
 * identical tokens, or (no holder left) ends the request with SHOAL_ERR_PEER_LOST; either way
 * nothing hangs and no KV or stream is left behind. Bad frames on a live link get typed errors.
 */
import type { Libp2p, Stream } from '@libp2p/interface'
import { Uint8ArrayList } from 'uint8arraylist'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import type { StageEngine } from '../../daemon/engine/index.ts'
import { createChainTokenSource, decodePayload, encodeFrame, STAGE_PROTOCOL } from '../../daemon/pipeline/index.ts'
import type { StageFrame } from '../../daemon/pipeline/index.ts'
import { buildModels, chainFrom, createNode, eventually, holderOf, kill, referenceTokens, runSource, startStage, startWholeEngine, stopHost } from './fixture.ts'
import type { Models, StageHost } from './fixture.ts'

const N = 64
const prompt = [1, 17, 300, 42, 42, 9, 250, 11]
const greedy = { temperature: 0, topP: 1 }

let models: Models
let want: number[]
const hosts: StageHost[] = []

beforeAll(async () => {
  models = await buildModels()
  const whole: StageEngine = await startWholeEngine(models)
  want = await referenceTokens(whole, prompt, N)
  await whole.stop()
}, 120_000)
afterAll(async () => {
  for (const h of hosts) await stopHost(h).catch(() => {})
  await models?.cleanup()
})

async function stage (dir: string, layers: [number, number]): Promise<StageHost> {
  const h = await startStage(dir, layers)
  hosts.push(h)
  return h
}

/** The host's engine stops answering (every step hangs until aborted); its links stay up. */
function freeze (h: StageHost): void {
  const hang = async (...args: unknown[]): Promise<never> => await new Promise((_resolve, reject) => {
    const signal = args.find((a): a is AbortSignal => a instanceof AbortSignal)
    signal?.addEventListener('abort', () => { reject(signal.reason as Error) }, { once: true })
  })
  Object.assign(h.stage.node.engine, { step: hang, stepBatch: hang })
}

async function expectClean (h: StageHost): Promise<void> {
  const e = await eventually(() => h.stage.node.engine.stats(), v => v.liveSequences === 0)
  expect(e).toMatchObject({ liveSequences: 0, kvBytes: 0 })
  expect(await eventually(() => h.stage.node.stats(), v => v.served === 0 && v.watched === 0)).toMatchObject({ served: 0, watched: 0 })
}

describe('a stage killed mid-generation', () => {
  it('is replaced by another holder of its layers: same tokens, no error', async () => {
    const [c, d, e, spare] = [await stage(models.three, [0, 1]), await stage(models.three, [2, 2]), await stage(models.three, [3, 3]), await stage(models.three, [3, 3])]
    const src = createChainTokenSource({
      node: c.stage.node, requestId: 'replay-1', sampling: greedy, deadline: Date.now() + 60_000,
      formChain: chainFrom(c, () => [holderOf(d), holderOf(e, 1), holderOf(spare, 50)]),
    })
    let got: number[]
    try {
      got = await runSource(src, prompt, N, AbortSignal.timeout(60_000), async (i) => {
        if (i === 20) {
          expect(src.route).toEqual([c.peerId, d.peerId, e.peerId])
          expect((await e.stage.node.engine.stats()).liveSequences).toBe(1)
          await kill(e)
        }
      })
      expect(src.replays).toBe(1)
      expect(src.route).toEqual([c.peerId, d.peerId, spare.peerId])
    } finally {
      await src.close()
    }
    expect(got).toEqual(want)
    for (const h of [c, d, spare]) await expectClean(h)
    expect(c.stage.node.stats().streams).toBe(2) // c→d, and spare→c for the tokens
  }, 120_000)

  it('a stage that falls silent once the mesh lost contact with it is replaced at once, not after the idle timeout', async () => {
    const [c, d, e, spare] = [await stage(models.three, [0, 1]), await stage(models.three, [2, 2]), await stage(models.three, [3, 3]), await stage(models.three, [3, 3])]
    const lost = new Map<string, AbortController>()
    const lossOf = (peerId: string): AbortController => lost.get(peerId) ?? lost.set(peerId, new AbortController()).get(peerId)!
    const src = createChainTokenSource({
      node: c.stage.node, requestId: 'silent-1', sampling: greedy, deadline: Date.now() + 120_000,
      formChain: chainFrom(c, () => [holderOf(d), holderOf(e, 1), holderOf(spare, 50)]),
      // The idle bound alone would wait 10 minutes: only the loss signal can end the wait in time.
      idleTimeoutMs: 600_000,
      peerLost: peerId => ({ signal: lossOf(peerId).signal, release: () => {} }),
    })
    let got: number[]
    try {
      got = await runSource(src, prompt, N, AbortSignal.timeout(60_000), (i) => {
        if (i !== 20) return
        expect(src.route).toEqual([c.peerId, d.peerId, e.peerId])
        // e hangs without closing anything (as a SIGKILLed QUIC peer looks), and the mesh says so.
        freeze(e)
        lossOf(e.peerId).abort()
      })
      expect(src.replays).toBe(1)
      expect(src.route).toEqual([c.peerId, d.peerId, spare.peerId])
    } finally {
      await src.close()
    }
    expect(got).toEqual(want)
    for (const h of [c, d, spare]) await expectClean(h)
  }, 120_000)

  it('with no other holder, ends with a typed error naming the missing layers and leaks nothing', async () => {
    const [c, d, e] = [await stage(models.three, [0, 1]), await stage(models.three, [2, 2]), await stage(models.three, [3, 3])]
    const src = createChainTokenSource({
      node: c.stage.node, requestId: 'lost-1', sampling: greedy, deadline: Date.now() + 60_000,
      formChain: chainFrom(c, () => [holderOf(d), holderOf(e)].filter(h => h.peerId !== d.peerId || d.libp2p.status === 'started')),
    })
    const run = runSource(src, prompt, N, AbortSignal.timeout(60_000), async (i) => { if (i === 10) await kill(d) })
    await expect(run).rejects.toMatchObject({ code: 'SHOAL_ERR_CHAIN_INCOMPLETE', message: expect.stringMatching(/layers 2\b/) })
    await src.close()
    await expectClean(c)
    await expectClean(e) // downstream of the lost stage: freed when its upstream link went down
    // Links to the dead stage are gone; only the idle ring link e → c (both alive) stays open.
    expect(await eventually(() => e.stage.node.stats().streams, n => n === 1)).toBe(1)
    expect(await eventually(() => c.stage.node.stats().streams, n => n === 1)).toBe(1)
  }, 120_000)

  it('a request right after the only other stage died is CHAIN_INCOMPLETE, as one after the mesh noticed (issue 13 #7)', async () => {
    const [c, d] = [await stage(models.two, [0, 1]), await stage(models.two, [2, 3])]
    // Warm the link, then kill the stage: the mesh has not noticed yet, so d is still offered.
    const warm = createChainTokenSource({ node: c.stage.node, requestId: 'warm-7', sampling: greedy, deadline: Date.now() + 60_000, formChain: chainFrom(c, () => [holderOf(d)]) })
    expect(await runSource(warm, prompt, 2, AbortSignal.timeout(60_000))).toEqual(want.slice(0, 2))
    await warm.close()
    await kill(d)
    const soon = createChainTokenSource({ node: c.stage.node, requestId: 'soon-7', sampling: greedy, deadline: Date.now() + 60_000, formChain: chainFrom(c, () => [holderOf(d)]) })
    await expect(runSource(soon, prompt, N, AbortSignal.timeout(60_000))).rejects.toMatchObject({ code: 'SHOAL_ERR_CHAIN_INCOMPLETE' })
    await soon.close()
    // Later the mesh no longer offers d: the same code.
    const later = createChainTokenSource({ node: c.stage.node, requestId: 'later-7', sampling: greedy, deadline: Date.now() + 60_000, formChain: chainFrom(c, () => []) })
    await expect(runSource(later, prompt, N, AbortSignal.timeout(60_000))).rejects.toMatchObject({ code: 'SHOAL_ERR_CHAIN_INCOMPLETE' })
    await later.close()
    await expectClean(c)
  }, 120_000)

  it('with replays off, fails at once with SHOAL_ERR_PEER_LOST naming the peer', async () => {
    const [c, d] = [await stage(models.two, [0, 1]), await stage(models.two, [2, 3])]
    const src = createChainTokenSource({
      node: c.stage.node, requestId: 'lost-2', sampling: greedy, deadline: Date.now() + 60_000, maxReplays: 0,
      formChain: chainFrom(c, () => [holderOf(d)]),
    })
    const run = runSource(src, prompt, N, AbortSignal.timeout(60_000), async (i) => { if (i === 5) await kill(d) })
    await expect(run).rejects.toMatchObject({ name: 'StageLostError', code: 'SHOAL_ERR_PEER_LOST', peerId: d.peerId })
    await src.close()
    await expectClean(c)
    expect(c.stage.node.stats().streams).toBe(0)
  }, 120_000)
})

describe('bad frames on a live link', () => {
  let target: StageHost

  beforeAll(async () => { target = await stage(models.two, [2, 3]) }, 60_000)

  async function rawLink (): Promise<{ stream: Stream, next: (ms?: number) => Promise<StageFrame | 'closed'> }> {
    const me = await createNode()
    const stream = await me.dialProtocol(target.libp2p.getMultiaddrs(), STAGE_PROTOCOL)
    const buf = new Uint8ArrayList()
    let closed = false
    let wake: (() => void) | undefined
    stream.addEventListener('message', (evt) => { buf.append(evt.data); wake?.() })
    stream.addEventListener('close', () => { closed = true; wake?.() })
    const next = async (ms = 5_000): Promise<StageFrame | 'closed'> => {
      const until = Date.now() + ms
      for (;;) {
        let len = 0
        let i = 0
        for (let scale = 1; i < buf.byteLength; i++, scale *= 128) {
          len += (buf.get(i) & 0x7f) * scale
          if ((buf.get(i) & 0x80) === 0) break
        }
        if (i < buf.byteLength && buf.byteLength >= i + 1 + len) {
          const f = decodePayload(buf.subarray(i + 1, i + 1 + len))
          buf.consume(i + 1 + len)
          return f
        }
        if (closed) return 'closed'
        if (Date.now() > until) throw new Error('no frame in time')
        await new Promise<void>(resolve => { wake = resolve; setTimeout(resolve, 50) })
      }
    }
    hostsToStop.push(me)
    return { stream, next }
  }
  const hostsToStop: Libp2p[] = []
  afterAll(async () => { for (const n of hostsToStop) await n.stop() })

  it('answers a wrong version, an unknown kind and an unknown request with typed errors, and keeps the link', async () => {
    const { stream, next } = await rawLink()
    const tok = encodeFrame({ kind: 'token', requestId: 'q1', position: 1, tokenId: 2 })
    const v9 = tok.slice(); v9[1] = 9
    stream.send(v9)
    expect(await next()).toMatchObject({ kind: 'error', requestId: 'q1', error: { code: 'SHOAL_ERR_STAGE_UNSUPPORTED_VERSION' } })
    const k = tok.slice(); k[2] = 77
    stream.send(k)
    expect(await next()).toMatchObject({ kind: 'error', requestId: 'q1', error: { code: 'SHOAL_ERR_STAGE_UNKNOWN_KIND' } })
    stream.send(encodeFrame({ kind: 'activation', requestId: 'nobody', start: 0, final: true, rows: 1, width: 64, data: new Float32Array(64) }).subarray())
    const f = await next()
    expect(f).toMatchObject({ kind: 'error', requestId: 'nobody', error: { code: 'SHOAL_ERR_STAGE_UNKNOWN_REQUEST' } })
    stream.send(encodeFrame({
      kind: 'open', requestId: 'wrong',
      open: { modelId: 'chain-test', manifestHash: 'not-this-one', chain: [{ peerId: 'x', layers: [0, 1] }, { peerId: target.peerId, layers: [2, 3] }], hop: 1, returnTo: 'x', sampling: greedy, rngSkip: 0, deadline: Date.now() + 10_000 },
    }))
    expect(await next()).toMatchObject({ kind: 'error', requestId: 'wrong', error: { code: 'SHOAL_ERR_STAGE_MISMATCH' } })
    expect(stream.status).toBe('open')
    expect(target.stage.node.stats().served).toBe(0)
    await stream.close()
    expect(await eventually(() => target.stage.node.stats().streams, n => n === 0)).toBe(0)
  }, 30_000)

  it('refuses an oversized frame with a typed error and resets the link', async () => {
    const { stream, next } = await rawLink()
    stream.send(Uint8Array.of(0xff, 0xff, 0xff, 0xff, 0x0f)) // length ~2^32: over the cap
    expect(await next()).toMatchObject({ kind: 'error', requestId: '', error: { code: 'SHOAL_ERR_STAGE_TOO_LARGE' } })
    expect(await next()).toBe('closed')
    expect(await eventually(() => target.stage.node.stats().streams, n => n === 0)).toBe(0)
  }, 30_000)

  it('drops a link that ends inside a frame, holding nothing', async () => {
    const { stream } = await rawLink()
    const bytes = encodeFrame({ kind: 'cancel', requestId: 'half' })
    stream.send(bytes.subarray(0, 3))
    await stream.close()
    expect(await eventually(() => target.stage.node.stats().streams, n => n === 0)).toBe(0)
    expect(target.stage.node.stats().served).toBe(0)
  }, 30_000)
})
