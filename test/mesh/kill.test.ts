/**
 * A node killed with SIGKILL (a child process, so nothing closes cleanly) disappears from every
 * peer table within the liveness bound; restarted from the same identity it rejoins everywhere.
 */
import type { ChildProcess } from 'node:child_process'
import { afterAll, beforeAll, describe, it } from 'vitest'
import { FAST, addrOf, createThrowawayCa, spawnFixtureNode as spawnNode, startNode, tempDir, waitFor } from './helpers.ts'
import type { TestNode } from './helpers.ts'

describe('a node killed with SIGKILL', () => {
  let cleanup: () => Promise<void>
  const nodes: TestNode[] = []
  const children: ChildProcess[] = []
  let killedDir: string

  beforeAll(async () => {
    const t = await tempDir('kill')
    cleanup = t.cleanup
    const ca = await createThrowawayCa(t.dir, ['a', 'b', 'k'])
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

  it('disappears from every peer table within the liveness bound, and rejoins when restarted', async () => {
    const first = await spawnNode(killedDir, addrOf(nodes[0]!.mesh))
    children.push(first.child)
    await waitFor('both nodes see k', () => nodes.every(n => seenBy(n, first.peerId)))
    first.child.kill('SIGKILL')
    // Bound: goneAfterMs of silence, plus a sweep and a poll of slack.
    await waitFor('k gone everywhere', () => nodes.every(n => !n.mesh.snapshot().peers.some(p => p.peerId === first.peerId)), (FAST.goneAfterMs ?? 0) + 5_000)
    const again = await spawnNode(killedDir, addrOf(nodes[1]!.mesh))
    children.push(again.child)
    await waitFor('k rejoined everywhere', () => nodes.every(n => seenBy(n, again.peerId)))
    again.child.kill('SIGTERM')
  })
})
