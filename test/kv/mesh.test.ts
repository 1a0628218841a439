/**
 * /shoal/kv/1.0.0 behind the real mesh's admission, with the daemon's rule: a holder serves its
 * kept prefixes only to admitted peers (the mesh's handle; a stranger's stream never reaches the
 * handler) and, of those, only to workers (roleRefusal 'kv'). CA-issued certificates, meshes on
 * loopback; the store is a stand-in (the engine side is test/kv/move.test.ts).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createKvPuller, KV_PROTOCOL, serveKv } from '../../daemon/kv/index.ts'
import type { KvStore, KvStoreInfo, PullOutcome } from '../../daemon/kv/index.ts'
import { roleRefusal } from '../../daemon/node/roles.ts'
import { addrOf, createThrowawayCa, startNode, tempDir, waitFor } from '../mesh/helpers.ts'
import type { TestNode } from '../mesh/helpers.ts'
import { createTestNode } from '../routing/nodes.ts'

const INFO: KvStoreInfo = { modelId: 'm', manifestHash: 'a'.repeat(64), layers: [0, 3], dtype: 'float32', numKvHeads: 2, headDim: 4 }
const TOKENS = Array.from({ length: 40 }, (_, i) => 10 + i)

/** Keeps one prefix: the first 32 of TOKENS, with values derived from their positions. */
function holderStore (): KvStore {
  return {
    info: () => INFO,
    async exportPrefix (tokens) {
      let n = 0
      while (n < 32 && n < tokens.length && tokens[n] === TOKENS[n]) n++
      if (n < 16) return undefined
      return { tokens: n, layers: Array.from({ length: 8 }, (_, t) => Float32Array.from({ length: 2 * n * 4 }, (_, j) => t + j / 1000)) }
    },
    async importPrefix () { throw new Error('the holder imports nothing') },
  }
}

/** Records what it was given. */
function pullerStore (): KvStore & { got: Array<{ tokens: readonly number[], layers: Float32Array[] }> } {
  const got: Array<{ tokens: readonly number[], layers: Float32Array[] }> = []
  return {
    got,
    info: () => INFO,
    async exportPrefix () { return undefined },
    async importPrefix (tokens, layers) { got.push({ tokens, layers }); return { kept: true, bytes: layers.reduce((n, t) => n + t.byteLength, 0) } },
  }
}

describe('/shoal/kv/1.0.0 on real meshes', () => {
  let tmp: Awaited<ReturnType<typeof tempDir>>
  let otherTmp: Awaited<ReturnType<typeof tempDir>>
  const nodes: TestNode[] = []
  let holder: TestNode
  let worker: TestNode
  let ingressOnly: TestNode
  let stranger: TestNode
  const stops: Array<() => Promise<void>> = []

  beforeAll(async () => {
    tmp = await tempDir('kv-mesh')
    otherTmp = await tempDir('kv-mesh-other')
    const ca = await createThrowawayCa(tmp.dir, [
      { name: 'holder', roles: ['worker'] },
      { name: 'worker', roles: ['ingress', 'worker'] },
      { name: 'ingress-only', roles: ['ingress'] },
    ])
    // Certified by another CA: never admitted.
    const other = await createThrowawayCa(otherTmp.dir, [{ name: 'stranger', roles: ['ingress', 'worker'] }])
    holder = await startNode(ca.identities[0]!, 'tcp')
    const boot = [addrOf(holder.mesh)]
    worker = await startNode(ca.identities[1]!, 'tcp', boot)
    ingressOnly = await startNode(ca.identities[2]!, 'tcp', boot)
    stranger = await startNode(other.identities[0]!, 'tcp', boot)
    nodes.push(holder, worker, ingressOnly, stranger)
    const roles = holder.identity.certificate.body.roles
    const server = await serveKv({ stores: () => [holderStore()], authorize: from => roleRefusal('kv', roles, from, holder.mesh.certificateOf(from)?.body.roles) }, {
      handle: async (p, h) => { await holder.mesh.handle(p, h) },
      openStream: async (peer, p, signal) => await holder.mesh.openStream(peer, p, signal),
    })
    stops.push(async () => { await server.stop() })
    for (const n of [worker, ingressOnly]) await waitFor('admitted both ways', () => n.mesh.isAdmitted(holder.mesh.peerId) && holder.mesh.isAdmitted(n.mesh.peerId))
  }, 60_000)
  afterAll(async () => {
    for (const s of stops) await s().catch(() => {})
    await Promise.all(nodes.map(async n => { await n.mesh.stop() }))
    await tmp?.cleanup()
    await otherTmp?.cleanup()
  })

  const pull = async (from: TestNode, open?: (signal: AbortSignal) => Promise<never>): Promise<{ outcome: PullOutcome, store: ReturnType<typeof pullerStore> }> => {
    const store = pullerStore()
    const puller = createKvPuller({ blockSize: 8 }, {
      openStream: async (peer, p, signal) => open === undefined ? await from.mesh.openStream(peer, p, signal) : await open(signal),
      store: () => store,
    })
    return { outcome: await puller.pull({ peerId: holder.mesh.peerId, model: 'm', tokens: TOKENS.slice(0, 38), signal: AbortSignal.timeout(15_000) }), store }
  }

  it('an admitted worker pulls the prefix; what it imports is exactly what the holder keeps', async () => {
    const { outcome, store } = await pull(worker)
    expect(outcome).toMatchObject({ ok: true, tokens: 32, bytes: 8 * 2 * 32 * 4 * 4 })
    expect(store.got).toHaveLength(1)
    expect(store.got[0]!.tokens).toEqual(TOKENS.slice(0, 32))
    expect(store.got[0]!.layers).toEqual((await holderStore().exportPrefix(TOKENS, AbortSignal.timeout(1000)))!.layers)
  })

  it('an admitted peer that is not a worker is refused with a typed error, and imports nothing', async () => {
    const { outcome, store } = await pull(ingressOnly)
    expect(outcome).toMatchObject({ ok: false, code: 'SHOAL_ERR_KV_REFUSED' })
    expect(store.got).toHaveLength(0)
  })

  it('a peer that is not admitted never reaches the holder: its own mesh will not open the stream, and a bare libp2p node is cut off', async () => {
    expect(stranger.mesh.isAdmitted(holder.mesh.peerId)).toBe(false)
    const viaMesh = await pull(stranger)
    expect(viaMesh.outcome).toMatchObject({ ok: false, code: 'SHOAL_ERR_MESH_NOT_ADMITTED' })
    // A node outside any mesh (no certificate, no admission) dials the holder's libp2p directly.
    const bare = await createTestNode()
    try {
      const raw = await pull(stranger, async (signal) => await bare.dialProtocol(holder.mesh.libp2p.getMultiaddrs(), KV_PROTOCOL, { signal }) as never)
      expect(raw.outcome.ok, JSON.stringify(raw.outcome)).toBe(false)
      expect(raw.store.got).toHaveLength(0)
    } finally {
      await bare.stop()
    }
  }, 30_000)
})
