/**
 * A node SIGKILLed and restarted from the same identity at once — before its peers have given
 * its old instance up — must rejoin every peer, not only the one it bootstraps to. The chaos
 * suite (reproduction/chaos.ts) found a restarted pipeline stage 0 admitted by its bootstrap
 * ingresses only: the stage-1 holders gave its old instance up a moment after the restart,
 * dropped it from their dial targets, and never met the new one, so the chain stayed broken.
 */
import { createSocket } from 'node:dgram'
import { describe, it } from 'vitest'
import { FAST, addrOf, spawnFixtureNode as spawnNode, waitFor, withKillableThird } from './helpers.ts'

async function freeUdpPort (): Promise<number> {
  const socket = createSocket('udp4')
  await new Promise<void>((resolve, reject) => { socket.once('error', reject); socket.bind(0, '127.0.0.1', resolve) })
  const port = socket.address().port
  await new Promise<void>(resolve => socket.close(() => resolve()))
  return port
}

describe('a node SIGKILLed and restarted at once', () => {
  const suite = withKillableThird('restart', ['hub', 'other', 'k'])
  const { nodes, children, seenBy } = suite

  it('rejoins the peers it does not bootstrap to, after they gave its old instance up', async () => {
    const listen = `/ip4/127.0.0.1/udp/${await freeUdpPort()}/quic-v1`
    const first = await spawnNode(suite.killedDir, addrOf(nodes[0]!.mesh), listen)
    children.push(first.child)
    await waitFor('both nodes see k', () => nodes.every(n => seenBy(n, first.peerId)))
    first.child.kill('SIGKILL')
    await new Promise(resolve => first.child.once('exit', resolve))
    // Back at once, bootstrapping to the hub only; "other" still holds the old instance.
    const again = await spawnNode(suite.killedDir, addrOf(nodes[0]!.mesh), listen)
    children.push(again.child)
    // Bound: the old instance given up (goneAfterMs) plus a few republish rounds and redials.
    await waitFor('k rejoined the node it does not bootstrap to', () => seenBy(nodes[1]!, again.peerId), (FAST.goneAfterMs ?? 0) + 4 * (FAST.capsRepublishMs ?? 0) + 10_000)
    again.child.kill('SIGTERM')
  })
})
