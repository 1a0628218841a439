/**
 * `shoal node --announce`: the addresses peers are told to dial instead of the listen addresses
 * (a NAT, or the chaos suite's lossy relay in front of a node). The config carries them, the
 * daemon's libp2p node announces exactly those (not its listen addresses), and a peer that meets
 * it learns those through identify.
 */
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { pino } from 'pino'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { DaemonConfig } from '../../daemon/node/index.ts'
import { addrOf, createThrowawayCa, startNode, tempDir, waitFor } from '../mesh/helpers.ts'
import type { TestNode } from '../mesh/helpers.ts'

const base: DaemonConfig = { models: [], device: 'cpu', dataDir: '/tmp/d', cacheRoot: '/tmp/c', listen: [], bootstrap: [], mdns: false }
const ANNOUNCED = ['/ip4/127.0.0.2/udp/4999/quic-v1', '/ip4/127.0.0.2/tcp/4999']
const bare = (addrs: string[]): string[] => addrs.map(a => a.replace(/\/p2p\/[^/]+$/, '')).sort()

describe('daemon config: announce', () => {
  it('carries --announce, frozen', () => {
    const c = validateConfig({ ...base, identityDir: '/tmp/id', announce: ANNOUNCED })
    expect(c.announce).toEqual(ANNOUNCED)
    expect(Object.isFrozen(c.announce)).toBe(true)
    expect(validateConfig({ ...base, identityDir: '/tmp/id', announce: [] }).announce).toEqual([])
    expect(validateConfig({ ...base, identityDir: '/tmp/id' }).announce).toBeUndefined()
  })
})

describe('a daemon with --announce', () => {
  let tmp: Awaited<ReturnType<typeof tempDir>>
  let peer: TestNode
  let daemon: ReturnType<typeof createDaemon>

  beforeAll(async () => {
    tmp = await tempDir('announce')
    const ca = await createThrowawayCa(tmp.dir, [{ name: 'peer', roles: ['ingress', 'worker'] }, { name: 'announcer', roles: ['worker'] }])
    peer = await startNode(ca.identities[0]!, 'tcp')
    daemon = createDaemon(validateConfig({
      ...base,
      identityDir: ca.identities[1]!.dir,
      dataDir: join(tmp.dir, 'announcer-data'),
      cacheRoot: join(tmp.dir, 'cache'),
      listen: ['/ip4/127.0.0.1/tcp/0'],
      announce: ANNOUNCED,
      bootstrap: [addrOf(peer.mesh)],
    }), { logger: pino({ level: 'silent' }) })
    await daemon.start()
  }, 60_000)

  afterAll(async () => {
    await daemon?.stop()
    await peer?.mesh.stop()
    await tmp?.cleanup()
  })

  it('announces exactly those addresses, and its peers learn them instead of the listen address', async () => {
    const mesh = daemon.mesh!
    expect(bare(mesh.libp2p.getMultiaddrs().map(a => a.toString()))).toEqual([...ANNOUNCED].sort())
    let learned: string[] = []
    await waitFor('the peer learns the announced addresses', async () => {
      try {
        const p = await peer.mesh.libp2p.peerStore.get(mesh.libp2p.peerId)
        learned = p.addresses.map(a => a.multiaddr.toString())
      } catch { return false }
      return ANNOUNCED.every(a => learned.includes(a))
    })
    expect(learned.some(a => a.startsWith('/ip4/127.0.0.1/tcp/'))).toBe(false)
  }, 60_000)
})
