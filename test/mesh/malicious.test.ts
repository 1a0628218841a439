/**
 * A malicious but admitted peer: forged capability signatures, records for another peer id,
 * someone else's certificate, oversized, malformed and future-version gossip, garbage and floods
 * on the load protocol. Each is dropped and counted; the honest view survives and nothing
 * crashes. A peer that speaks only an unknown major version of admission is reported, not
 * crashed on.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLibp2p } from 'libp2p'
import { quic } from '@chainsafe/libp2p-quic'
import { identify } from '@libp2p/identify'
import { generateKeyPair } from '@libp2p/crypto/keys'
import { multiaddr } from '@multiformats/multiaddr'
import { lpStream } from '@libp2p/utils'
import * as ed from '@noble/ed25519'
import { signDocument } from '../../certs/index.ts'
import { CAPS_TOPIC, LOAD_PROTOCOL } from '../../daemon/mesh/index.ts'
import { capabilityBody, encodeCapsMessage } from '../../daemon/mesh/wire/caps.ts'
import type { CapabilityRecordBody } from '../../daemon/mesh/wire/caps.ts'
import { decodeLoadFrame, encodeLoadFrame } from '../../daemon/mesh/wire/load.ts'
import { addrOf, createThrowawayCa, dropped, startNode, tempDir, waitFor } from './helpers.ts'
import type { TestNode } from './helpers.ts'

describe('a malicious admitted peer', () => {
  let cleanup: () => Promise<void>
  let a: TestNode
  let m: TestNode
  let b: TestNode

  beforeAll(async () => {
    const t = await tempDir('malicious')
    cleanup = t.cleanup
    const ca = await createThrowawayCa(t.dir, ['a', 'm', 'b'])
    a = await startNode(ca.identities[0]!, 'quic')
    m = await startNode(ca.identities[1]!, 'quic', [addrOf(a.mesh)])
    b = await startNode(ca.identities[2]!, 'quic', [addrOf(a.mesh)])
    m.mesh.setCapabilities({ models: [{ id: 'honest' }] })
    await waitFor('a holds m\'s honest record', () => a.mesh.snapshot().peers.some(p => p.name === 'm' && p.models[0]?.id === 'honest'))
    await waitFor('m sees a', () => m.mesh.isAdmitted(a.mesh.peerId))
  })

  afterAll(async () => {
    for (const n of [a, m, b]) await n?.mesh.stop().catch(() => {})
    await cleanup()
  })

  const body = (patch: Partial<CapabilityRecordBody> = {}): CapabilityRecordBody => capabilityBody({
    peerId: m.mesh.peerId, name: 'm', seq: Date.now() * 2, issuedAt: Date.now(), addrs: [], protocols: [], models: [{ id: 'evil' }], ...patch,
  })
  const publish = async (data: Uint8Array): Promise<void> => { await m.mesh.libp2p.services.pubsub.publish(CAPS_TOPIC, data) }

  it.each([
    ['bad-signature', () => encodeCapsMessage(m.identity.certificate, signDocument(body(), ed.utils.randomSecretKey()))],
    ['other-peer', () => encodeCapsMessage(a.identity.certificate, signDocument(body({ peerId: a.mesh.peerId, name: 'a' }), m.identity.secretKey))],
    ['certificate-peer-id-mismatch', () => encodeCapsMessage(b.identity.certificate, signDocument(body({ name: 'b' }), m.identity.secretKey))],
    ['oversized', () => new Uint8Array(100 * 1024).fill(0x20)],
    ['malformed', () => new TextEncoder().encode('{"v":1,"type":"caps","certificate":{},"record":{"body":{"seq":"x"}}}')],
    ['malformed', () => new Uint8Array([0xff, 0xfe, 0x00])],
    ['unsupported-version', () => new TextEncoder().encode('{"v":9,"type":"caps"}')],
    ['future', () => encodeCapsMessage(m.identity.certificate, signDocument(body({ issuedAt: Date.now() + 3600_000 }), m.identity.secretKey))],
  ] as Array<[string, () => Uint8Array]>)('drops and counts %s gossip', async (reason, make) => {
    const before = await dropped(a, reason)
    await publish(make())
    await waitFor(`a counted ${reason}`, async () => await dropped(a, reason) > before)
    // The honest record stands, m is still admitted, a still works.
    const view = a.mesh.snapshot().peers.find(p => p.name === 'm')
    expect(view?.models).toEqual([{ id: 'honest' }])
    expect(a.mesh.isAdmitted(m.mesh.peerId)).toBe(true)
    // A record about `a` never lands anywhere as a's.
    expect(b.mesh.snapshot().peers.find(p => p.peerId === a.mesh.peerId)?.models.some(x => x.id === 'evil')).not.toBe(true)
  })

  async function wireErrors (node: TestNode, code: string): Promise<number> {
    const metric = await node.registry.getSingleMetric('shoal_mesh_wire_errors_total')?.get()
    return (metric?.values ?? []).filter(v => v.labels.code === code).reduce((s, v) => s + v.value, 0)
  }

  /**
   * A load stream from m to a, beside m's own poller's: `frames` written, then `replies` frames
   * read. a takes two inbound load streams a peer; on a loaded machine the poller's previous stream
   * can still count there for a moment after the poller reopens, and a then resets this one before
   * it answers. That is the stream limit at work, not what these tests ask, so such a stream is
   * opened again (three tries).
   */
  async function askLoad (frames: Uint8Array[], replies: number): Promise<{ stream: Awaited<ReturnType<typeof m.mesh.openStream>>, lp: ReturnType<typeof lpStream>, got: Array<ReturnType<typeof decodeLoadFrame>> }> {
    for (let attempt = 1; ; attempt++) {
      const stream = await m.mesh.openStream(a.mesh.peerId, LOAD_PROTOCOL, AbortSignal.timeout(5000))
      const lp = lpStream(stream, { maxDataLength: 4096 })
      try {
        for (const f of frames) await lp.write(f)
        const got = []
        for (let i = 0; i < replies; i++) got.push(decodeLoadFrame((await lp.read({ signal: AbortSignal.timeout(5000) })).subarray()))
        return { stream, lp, got }
      } catch (err) {
        stream.abort(err as Error)
        if (attempt === 3 || (err as Error).name !== 'UnexpectedEOFError') throw err
        await new Promise(resolve => setTimeout(resolve, 200))
      }
    }
  }

  it('answers garbage on the load protocol with a typed error frame', async () => {
    const { stream, got: [reply] } = await askLoad([new TextEncoder().encode('{"v":1,"type":"nope","id":1}')], 1)
    expect(reply).toMatchObject({ type: 'error', code: 'SHOAL_ERR_MESH_MALFORMED' })
    stream.abort(new Error('done'))
  })

  it('rate-limits a load flood and survives an oversized frame', async () => {
    const { stream, lp, got: [first, second] } = await askLoad([encodeLoadFrame({ v: 1, type: 'req', id: 1 }), encodeLoadFrame({ v: 1, type: 'req', id: 2 })], 2)
    expect(first).toMatchObject({ type: 'load', id: 1 })
    expect(second).toMatchObject({ type: 'error', id: 2, code: 'SHOAL_ERR_MESH_RATE_LIMITED' })
    const before = await wireErrors(a, 'SHOAL_ERR_MESH_TOO_LARGE')
    await lp.write(new Uint8Array(64 * 1024))
    await waitFor('a counted the oversized frame', async () => await wireErrors(a, 'SHOAL_ERR_MESH_TOO_LARGE') > before)
    stream.abort(new Error('done'))
    // Still alive, still polled.
    await waitFor('a still sees m alive with load', () => a.mesh.snapshot().peers.some(p => p.name === 'm' && p.state === 'alive' && p.load !== undefined))
  })

  it('reports a peer that speaks only an unknown major version of admission', async () => {
    const stranger = await createLibp2p({
      privateKey: await generateKeyPair('Ed25519'),
      addresses: { listen: ['/ip4/127.0.0.1/udp/0/quic-v1'] },
      transports: [quic()],
      connectionMonitor: { enabled: false },
      services: { identify: identify() },
    })
    try {
      await stranger.handle('/shoal/admit/2.0.0', (stream) => { stream.abort(new Error('v2 only')) })
      await stranger.dial(multiaddr(addrOf(a.mesh)), { signal: AbortSignal.timeout(5000) })
      const id = stranger.peerId.toString()
      await waitFor('a reports the v2 peer', () => a.mesh.snapshot().peers.some(p => p.peerId === id && !p.admitted &&
        p.reason === 'unsupported-protocol-version' && p.unsupportedProtocols?.includes('/shoal/admit/2.0.0') === true))
      await waitFor('and disconnects it', () => a.mesh.libp2p.getConnections().every(c => c.remotePeer.toString() !== id))
    } finally {
      await stranger.stop()
    }
    expect(a.mesh.peers().map(p => p.name).sort()).toEqual(['b', 'm'])
  })
})
