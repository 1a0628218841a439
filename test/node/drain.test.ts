/**
 * Draining: a draining node's load replies say `accepting: false` (what routing and chain
 * formation already avoid), and accept again after drain(false); its own ingress routes elsewhere
 * when another node can serve, and serves itself rather than refuse when none can. A stop drains
 * first. The load reply is checked where peers read it: a real second daemon's peer table.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createThrowawayCa } from '../../certs/index.ts'
import { drainedLoad, lastResortLocal } from '../../daemon/node/drain.ts'
import type { LoadRecord } from '../../daemon/mesh/index.ts'
import type { Candidate } from '../../daemon/routing/index.ts'
import { startInProcess, waitFor } from '../mesh-e2e/harness.ts'
import type { MeshNode } from '../mesh-e2e/harness.ts'
import type { Daemon } from '../../daemon/node/index.ts'

const IDLE_LOAD: LoadRecord = { queueDepth: 0, inFlight: 0, decodeTokPerSec: 0, freeKvTokens: 0, expectedWaitMs: 0 }
const snapshot = (accepting?: boolean): NonNullable<Candidate['load']> => ({ observedAt: 0, queueDepth: 0, inFlight: 0, slots: 1, tokensPerSecond: 0, ...(accepting === undefined ? {} : { accepting }) })
const local = (accepting?: boolean): Candidate => ({ peerId: 'self', local: true, admitted: true, alive: true, wholeModel: true, load: snapshot(accepting) })
const peer = (over: Partial<Candidate> = {}, accepting?: boolean): Candidate => ({ peerId: 'p', local: false, admitted: true, alive: true, wholeModel: true, load: snapshot(accepting), ...over })

describe('drain, as pure functions', () => {
  it('a draining node\'s load says accepting: false; otherwise the load is unchanged', () => {
    expect(drainedLoad(IDLE_LOAD, true)).toEqual({ ...IDLE_LOAD, accepting: false })
    expect(drainedLoad(IDLE_LOAD, false)).toBe(IDLE_LOAD)
  })

  it('the local candidate stays not accepting while another node can take the request', () => {
    const all = [local(false), peer()]
    expect(lastResortLocal(all)).toEqual(all)
  })

  it('with no other node that can take it, the local candidate serves rather than refuse', () => {
    for (const others of [[], [peer({ alive: false })], [peer({ wholeModel: false })], [peer({}, false)]]) {
      const out = lastResortLocal([local(false), ...others])
      expect(out[0]!.load?.accepting).toBeUndefined()
      expect(out.slice(1)).toEqual(others)
    }
  })
})

describe('drain on a running daemon', () => {
  let root: string
  let a: MeshNode & { daemon: Daemon }
  let b: MeshNode & { daemon: Daemon }

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-drain-'))
    const ca = await createThrowawayCa(join(root, 'pki'), ['node-a', 'node-b'])
    const [ia, ib] = ca.identities
    a = await startInProcess({ name: 'node-a', identityDir: ia!.dir, root, api: true, bootstrap: [] })
    b = await startInProcess({ name: 'node-b', identityDir: ib!.dir, root, api: true, bootstrap: a.addrs })
  }, 120_000)

  afterAll(async () => {
    await b?.stop().catch(() => {})
    await a?.stop().catch(() => {})
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('its load replies say accepting: false while draining, and accept again after drain(false)', async () => {
    const heard = () => b.daemon.mesh!.peers().find(p => p.peerId === a.peerId)
    await waitFor('B to hear A\'s load', () => heard()?.load !== undefined)
    expect(heard()!.load!.accepting).toBeUndefined()
    expect(a.daemon.draining).toBe(false)

    a.daemon.drain()
    expect(a.daemon.draining).toBe(true)
    await waitFor('B to hear A is not accepting', () => heard()?.load?.accepting === false)
    // The node's own view in /v1/mesh says so too, and it is still a live peer.
    const mesh = await (await fetch(`${a.url!}/v1/mesh`)).json() as { self: { load?: { accepting?: boolean } } }
    expect(mesh.self.load?.accepting).toBe(false)
    expect(heard()!.state).toBe('alive')

    a.daemon.drain(false)
    expect(a.daemon.draining).toBe(false)
    const since = Date.now()
    await waitFor('B to hear A accepting again', () => (heard()?.loadAt ?? 0) > since && heard()?.load?.accepting === undefined)
  })

  it('a stop drains first', async () => {
    await b.stop()
    expect(b.daemon.draining).toBe(true)
  })
})
