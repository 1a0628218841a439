/**
 * Certificate roles, enforced: the pure decision, routing that never picks a peer without
 * `worker`, and real meshes (CA-issued certificates with different roles, admitted over libp2p)
 * whose /shoal/infer handlers refuse a forwarded request with SHOAL_ERR_ROLE_REFUSED unless this
 * node is a worker and the asker an ingress; and a daemon whose certificate lacks `ingress` refuses
 * to open an API.
 */
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { pino } from 'pino'
import { createDaemon, validateConfig, serveForwarded } from '../../daemon/node/index.ts'
import { ingressRefusal, roleRefusal } from '../../daemon/node/roles.ts'
import { meshModelCards, replicaCandidates, stageHolders } from '../../daemon/node/mesh-view.ts'
import { INFER_PROTOCOL, forwardGenerate } from '../../daemon/routing/index.ts'
import type { PeerView } from '../../daemon/mesh/index.ts'
import type { GenerateRequest } from '../../daemon/service.ts'
import { createSimulatedService } from '../support/simulated-service.ts'
import { addrOf, createThrowawayCa, startNode, tempDir, waitFor } from '../mesh/helpers.ts'
import type { TestNode } from '../mesh/helpers.ts'

describe('roleRefusal (pure)', () => {
  it('infer needs a worker here and an ingress asking; stage and experts need workers on both ends', () => {
    expect(roleRefusal('infer', ['worker'], 'p', ['ingress'])).toBeUndefined()
    expect(roleRefusal('infer', ['ingress', 'worker'], 'p', ['ingress', 'worker'])).toBeUndefined()
    expect(roleRefusal('infer', ['ingress'], 'p', ['ingress'])).toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED', message: expect.stringMatching(/only worker certificates execute/) })
    expect(roleRefusal('infer', ['worker'], 'p', ['worker'])).toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED', message: expect.stringMatching(/only ingress certificates may ask/) })
    expect(roleRefusal('infer', ['worker'], 'p', undefined)).toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED' })
    expect(roleRefusal('stage', ['worker'], 'p', ['worker'])).toBeUndefined()
    expect(roleRefusal('stage', ['worker'], 'p', ['ingress'])).toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED' })
    expect(roleRefusal('stage', ['ingress'], 'p', ['worker'])).toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED' })
    expect(roleRefusal('experts', ['worker'], 'p', ['worker'])).toBeUndefined()
    expect(roleRefusal('experts', ['worker'], 'p', ['ingress'])).toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED', message: expect.stringMatching(/expert computation/) })
    expect(roleRefusal('experts', ['ingress'], 'p', ['worker'])).toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED' })
    expect(ingressRefusal(['worker'], 'n')).toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED', message: expect.stringMatching(/only ingress certificates accept API traffic/) })
    expect(ingressRefusal(['ingress'], 'n')).toBeUndefined()
  })

  it('routing offers only worker peers as replicas, stage holders and served models', () => {
    const view = (peerId: string, roles: string[], layers?: [number, number]): PeerView => ({
      peerId, name: peerId, roles, state: 'alive',
      capabilities: { models: [layers === undefined ? { id: 'm' } : { id: 'm', layers, manifestHash: 'h', totalLayers: 4 }], software: 'x' } as never,
    })
    const peers = [view('w', ['worker']), view('i', ['ingress']), view('iw', ['ingress', 'worker'])]
    const self = { peerId: 'me', serves: false, load: { queueDepth: 0, inFlight: 0, decodeTokPerSec: 0, freeKvTokens: 0, expectedWaitMs: 0 } }
    expect(replicaCandidates('m', self, peers, 0).map(c => c.peerId)).toEqual(['w', 'iw'])
    expect(meshModelCards(peers)[0]?.servedBy).toEqual(['w', 'iw'])
    expect(stageHolders('m', [view('s0', ['worker'], [0, 1]), view('s1', ['ingress'], [2, 3])]).map(h => h.peerId)).toEqual(['s0'])
  })
})

describe('roles on real meshes', () => {
  let tmp: Awaited<ReturnType<typeof tempDir>>
  const nodes: TestNode[] = []
  let ingressOnly: TestNode
  let workerOnly: TestNode
  let worker2: TestNode
  let both: TestNode

  beforeAll(async () => {
    tmp = await tempDir('roles')
    const ca = await createThrowawayCa(tmp.dir, [
      { name: 'ingress-only', roles: ['ingress'] },
      { name: 'worker-only', roles: ['worker'] },
      { name: 'worker-2', roles: ['worker'] },
      { name: 'both', roles: ['ingress', 'worker'] },
    ])
    workerOnly = await startNode(ca.identities[1]!, 'tcp')
    nodes.push(workerOnly)
    const boot = [addrOf(workerOnly.mesh)]
    for (const i of [0, 2, 3]) nodes.push(await startNode(ca.identities[i]!, 'tcp', boot))
    ingressOnly = nodes[1]!
    worker2 = nodes[2]!
    both = nodes[3]!
    // Each node serves /shoal/infer with the daemon's rule over the roles its mesh admitted peers with.
    for (const n of nodes) {
      const roles = n.identity.certificate.body.roles
      await serveForwarded(n.mesh, createSimulatedService({ models: [{ id: 'sim' }] }), () => ({ queueDepth: 0, inFlight: 0, decodeTokPerSec: 0, freeKvTokens: 0, expectedWaitMs: 0 }),
        from => roleRefusal('infer', roles, from, n.mesh.certificateOf(from)?.body.roles))
    }
    for (const a of [ingressOnly, worker2, both]) {
      await waitFor('admitted both ways', () => a.mesh.isAdmitted(workerOnly.mesh.peerId) && workerOnly.mesh.isAdmitted(a.mesh.peerId))
    }
    await waitFor('ingress-only and both admitted each other', () => ingressOnly.mesh.isAdmitted(both.mesh.peerId) && both.mesh.isAdmitted(ingressOnly.mesh.peerId))
  })
  afterAll(async () => {
    await Promise.all(nodes.map(async n => { await n.mesh.stop() }))
    await tmp?.cleanup()
  })

  let seq = 0
  const request = (): GenerateRequest => ({
    requestId: `roles-${++seq}`, model: 'sim', prompt: { kind: 'text', text: 'hi' }, maxTokens: 4,
    sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 20_000,
  })
  async function forward (from: TestNode, to: TestNode): Promise<{ ok: true } | { ok: false, code: string }> {
    try {
      for await (const ev of forwardGenerate(s => from.mesh.openStream(to.mesh.peerId, INFER_PROTOCOL, s), request(), AbortSignal.timeout(20_000), { peerId: to.mesh.peerId })) {
        if (ev.type === 'end') return { ok: true }
      }
      return { ok: false, code: 'no end' }
    } catch (err) {
      return { ok: false, code: String((err as { code?: unknown }).code) }
    }
  }

  it('a worker runs requests an ingress forwards; refuses a worker asking; an ingress-only node runs nothing for others', async () => {
    expect(await forward(ingressOnly, workerOnly)).toEqual({ ok: true })
    expect(await forward(both, workerOnly)).toEqual({ ok: true })
    expect(await forward(worker2, workerOnly)).toEqual({ ok: false, code: 'SHOAL_ERR_ROLE_REFUSED' })
    expect(await forward(both, ingressOnly)).toEqual({ ok: false, code: 'SHOAL_ERR_ROLE_REFUSED' })
    expect(await forward(ingressOnly, both)).toEqual({ ok: true })
  })

  it('a daemon whose certificate lacks ingress refuses to open an API (typed, before listening)', async () => {
    const daemon = createDaemon(validateConfig({
      identityDir: join(tmp.dir, 'worker-2'),
      models: [],
      api: { host: '127.0.0.1', port: 0 },
      device: 'cpu',
      dataDir: join(tmp.dir, 'worker-2-daemon'),
      cacheRoot: join(tmp.dir, 'cache'),
      listen: ['/ip4/127.0.0.1/tcp/0'],
      bootstrap: [],
      mdns: false,
    }), { logger: pino({ level: 'silent' }) })
    await expect(daemon.start()).rejects.toMatchObject({ code: 'SHOAL_ERR_ROLE_REFUSED', message: expect.stringMatching(/only ingress certificates accept API traffic/) })
    await daemon.stop()
  })
})
