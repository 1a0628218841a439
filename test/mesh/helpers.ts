/** Shared pieces of the mesh tests: a throwaway CA, meshes on loopback, bounded polling. */
import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { setTimeout as sleep } from 'node:timers/promises'
import { Registry } from 'prom-client'
import { afterAll, beforeAll } from 'vitest'
import { createThrowawayCa } from '../../certs/index.ts'
import type { NodeIdentity } from '../../certs/index.ts'
import { createMesh } from '../../daemon/mesh/index.ts'
import type { Mesh, MeshTimings, Transport } from '../../daemon/mesh/index.ts'

/** Fast timings so liveness and refusals show within a few seconds. */
export const FAST: Partial<MeshTimings> = {
  admissionDeadlineMs: 3_000,
  refusalCooldownMs: 2_000,
  loadIntervalMs: 250,
  suspectAfterMs: 1_500,
  goneAfterMs: 4_000,
  capsRepublishMs: 3_000,
  capsTtlMs: 20_000,
  redialBaseMs: 300,
  redialMaxMs: 2_000,
}

export function listenFor (transport: Transport): string[] {
  return transport === 'quic' ? ['/ip4/127.0.0.1/udp/0/quic-v1'] : ['/ip4/127.0.0.1/tcp/0']
}

export async function tempDir (prefix: string): Promise<{ dir: string, cleanup: () => Promise<void> }> {
  const dir = await mkdtemp(join(tmpdir(), `shoal-${prefix}-`))
  return { dir, cleanup: async () => { await rm(dir, { recursive: true, force: true }) } }
}

export interface TestNode { mesh: Mesh, registry: Registry, identity: NodeIdentity }

export async function startNode (identity: NodeIdentity, transport: Transport, bootstrap: string[] = [], extra: { revocationsFile?: string } = {}): Promise<TestNode> {
  const registry = new Registry()
  const mesh = createMesh({
    identity,
    listen: listenFor(transport),
    transports: [transport],
    bootstrap,
    mdns: false,
    timings: FAST,
    ...extra,
  }, { metrics: registry })
  await mesh.start()
  return { mesh, registry, identity }
}

/** The first multiaddr of a mesh, with its peer id. */
export function addrOf (mesh: Mesh): string {
  const ma = mesh.libp2p.getMultiaddrs()[0]
  if (ma === undefined) throw new Error('mesh has no address')
  return ma.toString()
}

/** Polls `check` until it returns true or the bound passes (then throws with `what`). */
export async function waitFor (what: string, check: () => boolean | Promise<boolean>, boundMs = 20_000): Promise<void> {
  const until = Date.now() + boundMs
  while (Date.now() < until) {
    if (await check()) return
    await sleep(100)
  }
  throw new Error(`timed out waiting for: ${what}`)
}

export async function refusals (node: TestNode, reason?: string): Promise<number> {
  const metric = await node.registry.getSingleMetric('shoal_admission_refusals_total')?.get()
  return (metric?.values ?? []).filter(v => reason === undefined || v.labels.reason === reason).reduce((a, v) => a + v.value, 0)
}

export async function dropped (node: TestNode, reason?: string): Promise<number> {
  const metric = await node.registry.getSingleMetric('shoal_mesh_gossip_dropped_total')?.get()
  return (metric?.values ?? []).filter(v => reason === undefined || v.labels.reason === reason).reduce((a, v) => a + v.value, 0)
}

export { createThrowawayCa }

const FIXTURE = fileURLToPath(new URL('./fixtures/mesh-node.ts', import.meta.url))

/**
 * The fixture node (fixtures/mesh-node.ts) as a child process, so a test can SIGKILL it; `listen`
 * pins its address (a restarted node comes back where its peers last saw it).
 */
export async function spawnFixtureNode (identityDir: string, bootstrap: string, listen?: string): Promise<{ child: ChildProcess, peerId: string }> {
  const child = spawn(process.execPath, [FIXTURE, '--identity', identityDir, '--bootstrap', bootstrap, ...(listen === undefined ? [] : ['--listen', listen])], { stdio: ['ignore', 'pipe', 'inherit'] })
  const lines = createInterface({ input: child.stdout! })
  const first = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => { reject(new Error('fixture did not start within 30 s')) }, 30_000)
    lines.once('line', line => { clearTimeout(timer); resolve(line) })
    child.once('exit', code => { clearTimeout(timer); reject(new Error(`fixture exited with ${code}`)) })
  })
  return { child, peerId: (JSON.parse(first) as { peerId: string }).peerId }
}

/** A suite's two in-process nodes and the identity of a third, run as a child so that it can be killed. */
export interface KillableThird {
  /** The two in-process nodes, the second bootstrapped to the first. */
  readonly nodes: TestNode[]
  /** Children the test spawned (spawnFixtureNode): SIGKILLed after the suite if still running. */
  readonly children: ChildProcess[]
  /** The third identity's directory (after beforeAll). */
  readonly killedDir: string
  /** Whether `n` holds `peerId` admitted, alive, and serving the fixture's model. */
  seenBy (n: TestNode, peerId: string): boolean
}

/** Registers a suite's hooks: the two nodes and the third identity before it, everything stopped after it. */
export function withKillableThird (prefix: string, names: [string, string, string]): KillableThird {
  let cleanup: (() => Promise<void>) | undefined
  let killedDir: string | undefined
  const nodes: TestNode[] = []
  const children: ChildProcess[] = []
  beforeAll(async () => {
    const t = await tempDir(prefix)
    cleanup = t.cleanup
    const ca = await createThrowawayCa(t.dir, names)
    nodes.push(await startNode(ca.identities[0]!, 'quic'))
    nodes.push(await startNode(ca.identities[1]!, 'quic', [addrOf(nodes[0]!.mesh)]))
    killedDir = ca.identities[2]!.dir
  })
  afterAll(async () => {
    for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL')
    for (const n of nodes) await n.mesh.stop().catch(() => {})
    await cleanup?.()
  })
  return {
    nodes,
    children,
    get killedDir () {
      if (killedDir === undefined) throw new Error('withKillableThird: killedDir is set in beforeAll')
      return killedDir
    },
    seenBy: (n, peerId) => n.mesh.snapshot().peers.some(p => p.peerId === peerId && p.admitted && p.state === 'alive' && p.models.some(m => m.id === 'fixture-model')),
  }
}
