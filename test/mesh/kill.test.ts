/**
 * A node killed with SIGKILL (a child process, so nothing closes cleanly) disappears from every
 * peer table within the liveness bound; restarted from the same identity it rejoins everywhere.
 */
import { describe, it } from 'vitest'
import { FAST, addrOf, spawnFixtureNode as spawnNode, waitFor, withKillableThird } from './helpers.ts'

describe('a node killed with SIGKILL', () => {
  const suite = withKillableThird('kill', ['a', 'b', 'k'])
  const { nodes, children, seenBy } = suite

  it('disappears from every peer table within the liveness bound, and rejoins when restarted', async () => {
    const first = await spawnNode(suite.killedDir, addrOf(nodes[0]!.mesh))
    children.push(first.child)
    await waitFor('both nodes see k', () => nodes.every(n => seenBy(n, first.peerId)))
    first.child.kill('SIGKILL')
    // Bound: goneAfterMs of silence, plus a sweep and a poll of slack.
    await waitFor('k gone everywhere', () => nodes.every(n => !n.mesh.snapshot().peers.some(p => p.peerId === first.peerId)), (FAST.goneAfterMs ?? 0) + 5_000)
    const again = await spawnNode(suite.killedDir, addrOf(nodes[1]!.mesh))
    children.push(again.child)
    await waitFor('k rejoined everywhere', () => nodes.every(n => seenBy(n, again.peerId)))
    again.child.kill('SIGTERM')
  })
})
