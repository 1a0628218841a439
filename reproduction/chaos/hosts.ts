/**
 * Where the chaos suite's nodes run: one Linux network namespace per node, each joined to a
 * bridge in the root namespace by a veth pair (the suite's process, which sends the load, reaches
 * every node through the bridge), or — without root — every node on 127.0.0.1 with its own ports.
 *
 * A partition cuts a host's veth on the bridge side (`ip link set … down`): QUIC (UDP) and TCP
 * both stop at once, nothing is closed, exactly a pulled cable; `heal` brings it back. This
 * kernel has `tc` without netem, so there is no injected delay or loss here; what it has is tbf,
 * a bandwidth cap whose queue adds delay (`throttle`). Fixed delay and loss come from user-space
 * relays on the bridge address (`gateway`, relay.ts) that the nodes announce. Loopback hosts
 * cannot be partitioned or throttled at all (no per-process network), and say so.
 */
import { execFileSync } from 'node:child_process'
import { createSocket } from 'node:dgram'
import { createServer } from 'node:net'
import { onCleanup } from './cleanup.ts'

export interface Host {
  name: string
  /** The address its node listens on and the suite reaches it at. */
  address: string
  /** libp2p port (QUIC on UDP and TCP share the number in netns mode). */
  quicPort: number
  tcpPort: number
  apiPort: number
  /** The command line that runs `argv` on this host. */
  wrap (argv: string[]): string[]
}

export interface Hosts {
  mode: 'netns' | 'loopback'
  hosts: Host[]
  /** The root namespace's address on the bridge, where a relay in front of a host listens (netns only). */
  gateway?: string
  /** Whether `partition` works here. */
  canPartition: boolean
  /** Cuts the host off the bridge (no packets in or out) until `heal`. */
  partition (host: Host): void
  heal (host: Host): void
  /** Caps the host's link both ways at `kbit` (tc tbf: a slow, queueing link) until `unthrottle`. */
  throttle (host: Host, kbit: number): void
  unthrottle (host: Host): void
  /** Removes namespaces, links and the bridge (also runs on exit and on Ctrl-C). */
  cleanup (): void
}

const NS_PREFIX = 'shoal-chaos-'
const LINK_PREFIX = 'shc'
const BRIDGE = `${LINK_PREFIX}-br0`
/** A /24 unlikely to collide with anything on a test machine. */
const SUBNET = '10.213.0'

const ip = (...args: string[]): string => execFileSync('ip', args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] })
const quietly = (f: () => unknown): void => { try { f() } catch {} }

/** True when this process may create network namespaces (root, `ip` present, a probe works). */
export function netnsAvailable (): boolean {
  if (process.platform !== 'linux' || process.getuid?.() !== 0) return false
  const probe = `${NS_PREFIX}probe-${process.pid}`
  try {
    ip('netns', 'add', probe)
    ip('netns', 'del', probe)
    return true
  } catch {
    quietly(() => ip('netns', 'del', probe))
    return false
  }
}

/** Deletes whatever an earlier run left behind (one that was SIGKILLed could not clean up). */
function removeLeftovers (): void {
  quietly(() => {
    for (const line of ip('netns', 'list').split('\n')) {
      const name = line.split(' ')[0] ?? ''
      if (name.startsWith(NS_PREFIX)) quietly(() => ip('netns', 'del', name))
    }
  })
  quietly(() => {
    for (const m of ip('-o', 'link', 'show').matchAll(new RegExp(`^\\d+: (${LINK_PREFIX}-[^:@]+)`, 'gm'))) quietly(() => ip('link', 'del', m[1]!))
  })
}

export function createNetnsHosts (names: string[]): Hosts {
  if (names.length > 200) throw new Error('at most 200 hosts')
  removeLeftovers()
  const created: Host[] = []
  const cleanup = (): void => {
    for (let i = 0; i < created.length; i++) {
      quietly(() => ip('link', 'del', `${LINK_PREFIX}-h${i}`))
      quietly(() => ip('netns', 'del', `${NS_PREFIX}${i}`))
    }
    quietly(() => ip('link', 'del', BRIDGE))
  }
  const unregister = onCleanup(cleanup)
  try {
    ip('link', 'add', BRIDGE, 'type', 'bridge')
    ip('addr', 'add', `${SUBNET}.1/24`, 'dev', BRIDGE)
    ip('link', 'set', BRIDGE, 'up')
    names.forEach((name, i) => {
      const ns = `${NS_PREFIX}${i}`
      const outer = `${LINK_PREFIX}-h${i}`
      const inner = `${LINK_PREFIX}-n${i}`
      const address = `${SUBNET}.${10 + i}`
      ip('netns', 'add', ns)
      created.push({
        name, address, quicPort: 4001, tcpPort: 4001, apiPort: 8080,
        wrap: argv => ['ip', 'netns', 'exec', ns, ...argv],
      })
      ip('link', 'add', outer, 'type', 'veth', 'peer', 'name', inner)
      ip('link', 'set', inner, 'netns', ns)
      ip('link', 'set', outer, 'master', BRIDGE)
      ip('link', 'set', outer, 'up')
      ip('-n', ns, 'link', 'set', 'lo', 'up')
      ip('-n', ns, 'link', 'set', inner, 'name', 'eth0')
      ip('-n', ns, 'addr', 'add', `${address}/24`, 'dev', 'eth0')
      ip('-n', ns, 'link', 'set', 'eth0', 'up')
    })
  } catch (err) {
    unregister()
    throw err
  }
  const linkOf = (host: Host): string => `${LINK_PREFIX}-h${created.indexOf(host)}`
  return {
    mode: 'netns',
    hosts: created,
    gateway: `${SUBNET}.1`,
    canPartition: true,
    partition: host => { ip('link', 'set', linkOf(host), 'down') },
    heal: host => { ip('link', 'set', linkOf(host), 'up') },
    throttle: (host, kbit) => {
      const ns = `${NS_PREFIX}${created.indexOf(host)}`
      const tbf = ['root', 'tbf', 'rate', `${kbit}kbit`, 'burst', '4kb', 'latency', '2s']
      execFileSync('tc', ['qdisc', 'replace', 'dev', linkOf(host), ...tbf])
      execFileSync('ip', ['netns', 'exec', ns, 'tc', 'qdisc', 'replace', 'dev', 'eth0', ...tbf])
    },
    unthrottle: host => {
      quietly(() => execFileSync('tc', ['qdisc', 'del', 'dev', linkOf(host), 'root'], { stdio: 'ignore' }))
      quietly(() => execFileSync('ip', ['netns', 'exec', `${NS_PREFIX}${created.indexOf(host)}`, 'tc', 'qdisc', 'del', 'dev', 'eth0', 'root'], { stdio: 'ignore' }))
    },
    cleanup: unregister,
  }
}

async function freeTcpPort (): Promise<number> {
  const server = createServer()
  await new Promise<void>((resolve, reject) => { server.once('error', reject); server.listen(0, '127.0.0.1', resolve) })
  const address = server.address()
  await new Promise<void>(resolve => server.close(() => resolve()))
  if (address === null || typeof address === 'string') throw new Error('no free TCP port')
  return address.port
}

async function freeUdpPort (): Promise<number> {
  const socket = createSocket('udp4')
  await new Promise<void>((resolve, reject) => { socket.once('error', reject); socket.bind(0, '127.0.0.1', resolve) })
  const port = socket.address().port
  await new Promise<void>(resolve => socket.close(() => resolve()))
  return port
}

/** Every host on 127.0.0.1 with ports picked now and kept (a restarted node comes back on them). */
export async function createLoopbackHosts (names: string[]): Promise<Hosts> {
  const hosts: Host[] = []
  for (const name of names) {
    hosts.push({ name, address: '127.0.0.1', quicPort: await freeUdpPort(), tcpPort: await freeTcpPort(), apiPort: await freeTcpPort(), wrap: argv => argv })
  }
  const refuse = (): never => { throw new Error('loopback hosts cannot be partitioned (no per-process network without namespaces)') }
  return { mode: 'loopback', hosts, canPartition: false, partition: refuse, heal: refuse, throttle: refuse, unthrottle: refuse, cleanup: () => {} }
}

/** Namespaces when allowed (`auto`), else loopback. */
export async function createHosts (names: string[], mode: 'auto' | 'netns' | 'loopback' = 'auto'): Promise<Hosts> {
  if (mode === 'netns' || (mode === 'auto' && netnsAvailable())) return createNetnsHosts(names)
  return await createLoopbackHosts(names)
}
