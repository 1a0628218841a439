/**
 * The faults the chaos suite injects into a running cluster, each ending with the cluster whole
 * again (or a record that it did not come back): a node SIGKILLed and restarted on its data
 * directory, a node hung with SIGSTOP and resumed with SIGCONT, a node cut off the network and
 * reconnected. Recovery is "every ingress that is up sees every node that is up, admitted and
 * alive with load, lists every model and serves one token of each" — what a client needs.
 */
import { setTimeout as sleep } from 'node:timers/promises'
import type { ChaosNode, Cluster } from './cluster.ts'
import type { Hosts } from './hosts.ts'
import type { Impairment, Relay, RelayStats } from './relay.ts'

export interface FaultRecord {
  /** The phase name the load tags its requests with. */
  name: string
  target: string
  /** How long the fault was held (ms). */
  heldMs: number
  /** From the fault to every other ingress listing the node as not alive; undefined: not seen within the hold. */
  detectedMs?: number
  /** From healing (restart, SIGCONT, link up) to the cluster whole again; undefined: it never was. */
  recoveryMs?: number
  note?: string
}

export interface FaultContext {
  cluster: Cluster
  hosts: Hosts
  models: string[]
  /** Sets the phase the load tags requests with. */
  setPhase (name: string): void
  /** How long the cluster may take to be whole again after a fault heals. */
  recoverWithinMs: number
  /** The relay in front of each node, by node name (`--relay`), for `lossyLink`. */
  relays?: Map<string, Relay>
}

interface MeshPeer { peerId: string, admitted: boolean, state: string, load?: unknown, addrs?: string[], rttMs?: number }

async function getJson<T> (url: string): Promise<T | undefined> {
  try {
    const res = await fetch(url, { signal: AbortSignal.timeout(5_000) })
    return res.ok ? await res.json() as T : undefined
  } catch {
    return undefined
  }
}

/** True when every up ingress sees every other up node alive and lists every model. */
export async function whole (cluster: Cluster, models: string[]): Promise<boolean> {
  const up = cluster.nodes.filter(n => n.state === 'up')
  for (const ingress of up.filter(n => n.url !== undefined)) {
    const mesh = await getJson<{ peers: MeshPeer[] }>(`${ingress.url}/v1/mesh`)
    if (mesh === undefined) return false
    for (const n of up) {
      if (n === ingress) continue
      if (!mesh.peers.some(p => p.peerId === n.peerId && p.admitted && p.state === 'alive' && p.load !== undefined)) return false
    }
    const listed = await getJson<{ data: Array<{ id: string }> }>(`${ingress.url}/v1/models`)
    if (listed === undefined || !models.every(m => listed.data.some(d => d.id === m))) return false
    // Listed is not served: a restarted stage 0 can be listed by the ingresses while it cannot
    // reach any stage 1. One token per model through each ingress must come back.
    for (const model of models) if (!await probe(ingress.url!, model)) return false
  }
  return true
}

async function probe (url: string, model: string): Promise<boolean> {
  try {
    const res = await fetch(`${url}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model, prompt: [1, 2, 3], max_tokens: 1, temperature: 0 }),
      signal: AbortSignal.timeout(10_000),
    })
    await res.arrayBuffer()
    return res.status === 200
  } catch {
    return false
  }
}

/** True when every up ingress other than `node` lists it as not alive (suspect, or gone). */
async function noticed (cluster: Cluster, node: ChaosNode): Promise<boolean> {
  for (const ingress of cluster.nodes.filter(n => n.state === 'up' && n.url !== undefined && n !== node)) {
    const mesh = await getJson<{ peers: MeshPeer[] }>(`${ingress.url}/v1/mesh`)
    if (mesh === undefined || mesh.peers.some(p => p.peerId === node.peerId && p.state === 'alive')) return false
  }
  return true
}

/**
 * Holds a fault for at least `minMs` and until the mesh has noticed it (bounded by `maxMs`), so
 * that what follows — a restart, a SIGCONT, a heal — meets a mesh that knows the node was gone.
 */
async function holdUntilNoticed (cluster: Cluster, node: ChaosNode, minMs: number, maxMs: number): Promise<{ heldMs: number, detectedMs?: number }> {
  const start = Date.now()
  let detectedMs: number | undefined
  while (Date.now() - start < maxMs) {
    if (detectedMs === undefined && await noticed(cluster, node)) detectedMs = Date.now() - start
    if (detectedMs !== undefined && Date.now() - start >= minMs) break
    await sleep(200)
  }
  return { heldMs: Date.now() - start, ...(detectedMs === undefined ? {} : { detectedMs }) }
}

/** Waits until `whole`; resolves with the ms it took, or undefined past `ms`. */
export async function waitWhole (cluster: Cluster, models: string[], ms: number): Promise<number | undefined> {
  const start = Date.now()
  while (Date.now() - start < ms) {
    if (await whole(cluster, models)) return Date.now() - start
    await sleep(250)
  }
  return undefined
}

const NOTICE_WITHIN_MS = 30_000

const record = (name: string, node: ChaosNode, held: { heldMs: number, detectedMs?: number }, recoveryMs: number | undefined): FaultRecord =>
  ({ name, target: node.spec.name, ...held, ...(recoveryMs === undefined ? { note: 'not whole again in time' } : { recoveryMs }) })

/** SIGKILL, held at least `minDownMs` and until the other ingresses list the node as not alive, then restarted on its data directory. */
export async function killAndRestart (ctx: FaultContext, node: ChaosNode, role: string, minDownMs: number): Promise<FaultRecord> {
  const name = `SIGKILL ${role}, restart on its data dir`
  ctx.setPhase(name)
  node.signal('SIGKILL')
  await node.exited()
  const held = await holdUntilNoticed(ctx.cluster, node, minDownMs, NOTICE_WITHIN_MS)
  await node.start()
  return record(name, node, held, await waitWhole(ctx.cluster, ctx.models, ctx.recoverWithinMs))
}

/** SIGSTOP (a hung peer: connections open, nothing answers), then SIGCONT. */
export async function hang (ctx: FaultContext, node: ChaosNode, role: string, minMs: number): Promise<FaultRecord> {
  const name = `SIGSTOP ${role} (hung peer), SIGCONT`
  ctx.setPhase(name)
  node.signal('SIGSTOP')
  let held
  try {
    held = await holdUntilNoticed(ctx.cluster, node, minMs, NOTICE_WITHIN_MS)
  } finally {
    node.signal('SIGCONT')
  }
  return record(name, node, held, await waitWhole(ctx.cluster, ctx.models, ctx.recoverWithinMs))
}

/** The host's link cut (no packets either way, nothing closed), then restored. */
export async function partition (ctx: FaultContext, node: ChaosNode, role: string, minMs: number): Promise<FaultRecord> {
  const name = `partition ${role} (link down), heal`
  ctx.setPhase(name)
  ctx.hosts.partition(node.spec.host)
  node.state = 'partitioned'
  let held
  try {
    held = await holdUntilNoticed(ctx.cluster, node, minMs, NOTICE_WITHIN_MS)
  } finally {
    ctx.hosts.heal(node.spec.host)
    if (node.state === 'partitioned') node.state = 'up'
  }
  return record(name, node, held, await waitWhole(ctx.cluster, ctx.models, ctx.recoverWithinMs))
}

/**
 * The host's link capped at `kbit` both ways (tbf: a slow link whose queue adds up to 2 s of
 * delay) for `heldMs`, then restored. The node may stay alive (slow answers) or be dropped as
 * silent; either way its requests must end cleanly and the mesh be whole afterwards.
 */
export async function slowLink (ctx: FaultContext, node: ChaosNode, role: string, kbit: number, heldMs: number): Promise<FaultRecord> {
  const name = `slow link ${role} (${kbit} kbit/s both ways), restore`
  ctx.setPhase(name)
  ctx.hosts.throttle(node.spec.host, kbit)
  try {
    await sleep(heldMs)
  } finally {
    ctx.hosts.unthrottle(node.spec.host)
  }
  return { name, target: node.spec.name, heldMs, ...(await waitWhole(ctx.cluster, ctx.models, ctx.recoverWithinMs).then(r => r === undefined ? { note: 'not whole again in time' } : { recoveryMs: r })) }
}

/** What the relays saw of a lossy link, and whether the mesh used them. */
export interface LossyLinkRecord extends FaultRecord {
  /** Summed over every relay, during the hold. */
  relayed: RelayStats
  /** The node's addresses as every up ingress lists them: all on its relay? */
  viaRelay: boolean
  /** The ingresses' round-trip estimates to the node at the end of the hold (ms). */
  rttMs: number[]
  /** Every other up ingress listed the node alive near the end of the hold. */
  aliveAtEnd: boolean
}

const sumStats = (xs: RelayStats[]): RelayStats => {
  const out: RelayStats = { udpDatagrams: 0, udpBytes: 0, udpLost: 0, udpOverflow: 0, udpFlows: 0, tcpConnections: 0, tcpBytes: 0, impaired: 0 }
  for (const x of xs) for (const k of Object.keys(out) as Array<keyof RelayStats>) out[k] += x[k]
  return out
}
const diffStats = (a: RelayStats, b: RelayStats): RelayStats => {
  const out = { ...b }
  for (const k of Object.keys(out) as Array<keyof RelayStats>) if (k !== 'udpFlows') out[k] -= a[k]
  return out
}

/**
 * The node's link made lossy and slow for `heldMs` through the relays (every node runs behind one,
 * `--relay`): its own relay impairs every flow, every other relay the flows the node opened — so
 * each packet to or from the node, on connections opened either way, waits `delayMs` each way and
 * each QUIC datagram is dropped with probability `loss`. Then cleared.
 */
export async function lossyLink (ctx: FaultContext, node: ChaosNode, role: string, impairment: Impairment, heldMs: number): Promise<LossyLinkRecord> {
  const relays = ctx.relays
  if (relays === undefined || !relays.has(node.spec.name)) throw new Error('lossyLink needs every node behind a relay (--relay)')
  const name = `lossy link ${role} (${impairment.delayMs} ms each way, ${(impairment.loss * 100).toFixed(0)} % UDP loss)`
  const ingresses = ctx.cluster.nodes.filter(n => n.state === 'up' && n.url !== undefined && n !== node)
  const views = async (): Promise<MeshPeer[]> => (await Promise.all(ingresses.map(async i => (await getJson<{ peers: MeshPeer[] }>(`${i.url}/v1/mesh`))?.peers.find(p => p.peerId === node.peerId))))
    .filter((p): p is MeshPeer => p !== undefined)
  const own = relays.get(node.spec.name)!
  const relayAddrs = [`/ip4/${ctx.hosts.gateway ?? ''}/udp/${own.udpPort}/quic-v1`, `/ip4/${ctx.hosts.gateway ?? ''}/tcp/${own.tcpPort}`]
  const before = await views()
  const viaRelay = before.length === ingresses.length && before.every(p => (p.addrs ?? []).length > 0 && (p.addrs ?? []).every(a => relayAddrs.includes(a.replace(/\/p2p\/[^/]+$/, ''))))
  ctx.setPhase(name)
  const at = sumStats([...relays.values()].map(r => r.stats()))
  own.impair(impairment)
  for (const [n, r] of relays) if (n !== node.spec.name) r.impair(impairment, client => client === node.spec.host.address)
  const start = Date.now()
  let rttMs: number[] = []
  let aliveAtEnd = false
  try {
    await sleep(Math.max(0, heldMs - 1_500))
    const end = await views()
    rttMs = end.map(p => p.rttMs).filter((x): x is number => x !== undefined)
    aliveAtEnd = end.length === ingresses.length && end.every(p => p.state === 'alive')
    await sleep(Math.max(0, heldMs - (Date.now() - start)))
  } finally {
    for (const r of relays.values()) r.clear()
  }
  const relayed = diffStats(at, sumStats([...relays.values()].map(r => r.stats())))
  const held = Date.now() - start
  const recoveryMs = await waitWhole(ctx.cluster, ctx.models, ctx.recoverWithinMs)
  return { name, target: node.spec.name, heldMs: held, ...(recoveryMs === undefined ? { note: 'not whole again in time' } : { recoveryMs }), relayed, viaRelay, rttMs, aliveAtEnd }
}
