/**
 * A node SIGKILLed and restarted from the same identity at once — before its peers have given
 * its old instance up — must rejoin every peer, not only the one it bootstraps to. The chaos
 * suite (reproduction/chaos.ts) found a restarted pipeline stage 0 admitted by its bootstrap
 * ingresses only: the stage-1 holders gave its old instance up a moment after the restart,
 * dropped it from their dial targets, and never met the new one, so the chain stayed broken.
 */
import { createSocket } from 'node:dgram'
import type { ChildProcess } from 'node:child_process'
import { afterAll, beforeAll, describe, it } from 'vitest'
import { FAST, addrOf, createThrowawayCa, spawnFixtureNode as spawnNode, startNode, tempDir, waitFor } from './helpers.ts'
import type { TestNode } from './helpers.ts'

async function freeUdpPort (): Promise<number> {
  const socket = createSocket('udp4')
  await new Promise<void>((resolve, reject) => { socket.once('error', reject); socket.bind(0, '127.0.0.1', resolve) })
  const port = socket.address().port
  await new Promise<void>(resolve => socket.close(() => resolve()))
  return port
}

describe('a node SIGKILLed and restarted at once', () => {
  let cleanup: () => Promise<void>
  const nodes: TestNode[] = []
  const children: ChildProcess[] = []
  let killedDir: string

  beforeAll(async () => {
    const t = await tempDir('restart')
    cleanup = t.cleanup
    const ca = await createThrowawayCa(t.dir, ['hub', 'other', 'k'])
    nodes.push(await startNode(ca.identities[0]!, 'quic'))
    nodes.push(await startNode(ca.identities[1]!, 'quic', [addrOf(nodes[0]!.mesh)]))
    killedDir = ca.identities[2]!.dir
  })

  afterAll(async () => {
    for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL')
    for (const n of nodes) await n.mesh.stop().catch(() => {})
    await cleanup()
  })

  const seenBy = (n: TestNode, peerId: string): boolean =>
    n.mesh.snapshot().peers.some(p => p.peerId === peerId && p.admitted && p.state === 'alive' && p.models.some(m => m.id === 'fixture-model'))

  it('rejoins the peers it does not bootstrap to, after they gave its old instance up', async () => {
    const listen = `/ip4/127.0.0.1/udp/${await freeUdpPort()}/quic-v1`
    const first = await spawnNode(killedDir, addrOf(nodes[0]!.mesh), listen)
    children.push(first.child)
    await waitFor('both nodes see k', () => nodes.every(n => seenBy(n, first.peerId)))
    first.child.kill('SIGKILL')
    await new Promise(resolve => first.child.once('exit', resolve))
    // Back at once, bootstrapping to the hub only; "other" still holds the old instance.
    const again = await spawnNode(killedDir, addrOf(nodes[0]!.mesh), listen)
    children.push(again.child)
    // Bound: the old instance given up (goneAfterMs) plus a few republish rounds and redials.
    await waitFor('k rejoined the node it does not bootstrap to', () => seenBy(nodes[1]!, again.peerId), (FAST.goneAfterMs ?? 0) + 4 * (FAST.capsRepublishMs ?? 0) + 10_000)
    again.child.kill('SIGTERM')
  })
})
