/**
 * A mesh of real `shoal node` processes for the chaos suite, one per host: identities from an
 * operator CA (made with the real CLI, `shoal ca init` / `ca issue`, or the same library calls
 * when speed matters), fixed listen addresses per host so a node restarted on its data directory
 * comes back where its peers' bootstrap lists point, and every node bootstrapping to the
 * ingresses. Each node's stderr goes to `<root>/logs/<name>.log` (appended across restarts).
 */
import { execFile, spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { createWriteStream } from 'node:fs'
import { mkdir } from 'node:fs/promises'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import { promisify } from 'node:util'
import { initCa, issueNode, loadIdentity } from '../../certs/index.ts'
import type { Role } from '../../certs/index.ts'
import { onCleanup } from './cleanup.ts'
import type { Host } from './hosts.ts'

const run = promisify(execFile)
export const SHOAL_BIN = fileURLToPath(new URL('../../scripts/shoal.mjs', import.meta.url))

export interface NodeSpec {
  name: string
  host: Host
  /** Model arguments for `--model` (`DIR` or `DIR@a-b`). */
  models: string[]
  /** Serve the OpenAI API (an ingress certificate); a node with models gets a worker certificate. */
  api: boolean
}

export type NodeState = 'up' | 'killed' | 'stopped' | 'partitioned' | 'exited'

export interface ChaosNode {
  spec: NodeSpec
  peerId: string
  identityDir: string
  dataDir: string
  /** API base URL (no /v1), when `spec.api`. */
  url?: string
  /** Multiaddrs with /p2p/<peerId>, QUIC first: the relay's when the node has one (`via`). */
  addrs: string[]
  state: NodeState
  pid (): number | undefined
  /** Starts the process (again, on the same data directory) and waits for its banner. */
  start (): Promise<void>
  /** Sends a signal; SIGKILL and SIGSTOP/SIGCONT update `state`. */
  signal (signal: NodeJS.Signals): void
  /** SIGTERM, then SIGKILL after `graceMs`; resolves once the process is gone. */
  stop (graceMs?: number): Promise<void>
  /** Resolves when the current process has exited. */
  exited (): Promise<void>
}

export interface ClusterInit {
  root: string
  specs: NodeSpec[]
  /** How identities are made: the real CLI (default) or the same library calls in this process. */
  ca?: 'cli' | 'library'
  /** SHOAL_CACHE for every node (compiled graphs are shared, the data directories are not). */
  cacheDir?: string
  startTimeoutMs?: number
  /**
   * A relay in front of a node (reproduction/chaos/relay.ts): the node announces the relay's
   * address (`--announce`, QUIC and TCP on `port`) and every bootstrap list names it, so peers'
   * connections to the node run through the relay.
   */
  via?: (spec: NodeSpec) => { host: string, port: number, quicOnly?: boolean } | undefined
}

export interface Cluster {
  caDir: string
  nodes: ChaosNode[]
  byName (name: string): ChaosNode
  /** Starts every node, ingresses first. */
  start (): Promise<void>
  /** Stops every node still running (SIGCONT first for a stopped one). */
  stop (): Promise<void>
}

/** `shoal …` through the real CLI; resolves with stdout. */
export async function shoal (args: string[], env: NodeJS.ProcessEnv = {}): Promise<string> {
  const { stdout } = await run(process.execPath, [SHOAL_BIN, ...args], { env: { ...process.env, NODE_OPTIONS: '', ...env }, maxBuffer: 256 * 1024 * 1024 })
  return stdout
}

async function makeIdentities (caDir: string, root: string, specs: NodeSpec[], how: 'cli' | 'library'): Promise<Map<string, { dir: string, peerId: string }>> {
  const out = new Map<string, { dir: string, peerId: string }>()
  const rolesOf = (s: NodeSpec): Role[] => [...(s.api ? ['ingress' as const] : []), ...(s.models.length > 0 ? ['worker' as const] : [])]
  if (how === 'cli') await shoal(['ca', 'init', '--dir', caDir])
  else await initCa(caDir, { name: 'shoal-chaos-ca' })
  for (const s of specs) {
    const dir = join(root, 'id', s.name)
    let peerId: string
    if (how === 'cli') {
      peerId = (await shoal(['ca', 'issue', '--dir', caDir, '--name', s.name, '--out', dir, '--roles', rolesOf(s).join(',')])).trim().split('\n').at(-1)!
    } else {
      await issueNode(caDir, { name: s.name, outDir: dir, roles: rolesOf(s) })
      peerId = (await loadIdentity(dir)).peerId
    }
    out.set(s.name, { dir, peerId })
  }
  return out
}

export async function createCluster (init: ClusterInit): Promise<Cluster> {
  const caDir = join(init.root, 'ca')
  const logs = join(init.root, 'logs')
  await mkdir(logs, { recursive: true })
  const ids = await makeIdentities(caDir, init.root, init.specs, init.ca ?? 'cli')
  const cacheDir = init.cacheDir ?? join(init.root, 'cache')
  const announced = (s: NodeSpec): string[] => {
    const v = init.via?.(s)
    if (v !== undefined) return [`/ip4/${v.host}/udp/${v.port}/quic-v1`, ...(v.quicOnly === true ? [] : [`/ip4/${v.host}/tcp/${v.port}`])]
    return [`/ip4/${s.host.address}/udp/${s.host.quicPort}/quic-v1`, `/ip4/${s.host.address}/tcp/${s.host.tcpPort}`]
  }
  const multiaddrs = (s: NodeSpec): string[] => {
    const { peerId } = ids.get(s.name)!
    return announced(s).map(a => `${a}/p2p/${peerId}`)
  }
  const ingresses = init.specs.filter(s => s.api)
  const live = new Set<ChildProcess>()
  onCleanup(() => { for (const c of live) c.kill('SIGKILL') })

  const nodes = init.specs.map((spec): ChaosNode => {
    const { dir: identityDir, peerId } = ids.get(spec.name)!
    const dataDir = join(init.root, 'data', spec.name)
    let child: ChildProcess | undefined
    let exit: Promise<void> = Promise.resolve()
    const log = createWriteStream(join(logs, `${spec.name}.log`), { flags: 'a' })
    const node: ChaosNode = {
      spec,
      peerId,
      identityDir,
      dataDir,
      ...(spec.api ? { url: `http://${spec.host.address}:${spec.host.apiPort}` } : {}),
      addrs: multiaddrs(spec),
      state: 'exited',
      pid: () => child?.pid,
      exited: () => exit,
      start: async () => {
        if (child !== undefined && child.exitCode === null && child.signalCode === null) throw new Error(`${spec.name} is already running`)
        const args = [process.execPath, SHOAL_BIN, 'node', '--identity', identityDir, '--data', dataDir, '--device', 'cpu', '--no-mdns',
          '--listen', `/ip4/${spec.host.address}/udp/${spec.host.quicPort}/quic-v1`, '--listen', `/ip4/${spec.host.address}/tcp/${spec.host.tcpPort}`,
          // Small fixed KV cache: several nodes share a small machine.
          '--kv-cache-mb', '16']
        if (init.via?.(spec) !== undefined) for (const a of announced(spec)) args.push('--announce', a)
        for (const m of spec.models) args.push('--model', m)
        if (spec.api) args.push('--api', `${spec.host.address}:${spec.host.apiPort}`)
        for (const other of ingresses) if (other !== spec) for (const a of multiaddrs(other)) args.push('--bootstrap', a)
        const [cmd, ...argv] = spec.host.wrap(args)
        log.write(`\n=== ${new Date().toISOString()} start: ${[cmd, ...argv].join(' ')}\n`)
        const c = spawn(cmd!, argv, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, SHOAL_CACHE: cacheDir, NODE_OPTIONS: '', SHOAL_LOG_LEVEL: process.env.SHOAL_LOG_LEVEL ?? 'warn' } })
        child = c
        live.add(c)
        c.stderr!.pipe(log, { end: false })
        exit = new Promise<void>(resolve => {
          c.once('exit', (code, sig) => {
            live.delete(c)
            log.write(`=== ${new Date().toISOString()} exit: ${code ?? sig}\n`)
            if (node.state === 'up' || node.state === 'stopped' || node.state === 'partitioned') node.state = 'exited'
            resolve()
          })
        })
        const lines = createInterface({ input: c.stdout! })
        await new Promise<void>((resolve, reject) => {
          const timer = setTimeout(() => { c.kill('SIGKILL'); reject(new Error(`${spec.name} did not start within ${init.startTimeoutMs ?? 120_000} ms (see ${logs}/${spec.name}.log)`)) }, init.startTimeoutMs ?? 120_000)
          lines.on('line', line => {
            log.write(`stdout: ${line}\n`)
            // The node prints "data in …" last, after its banner and listen addresses.
            if (/^\s+data in /.test(line)) { clearTimeout(timer); resolve() }
          })
          c.once('exit', (code, sig) => { clearTimeout(timer); reject(new Error(`${spec.name} exited (${code ?? sig}) before it was up (see ${logs}/${spec.name}.log)`)) })
        })
        node.state = 'up'
      },
      signal: (sig) => {
        if (child === undefined || child.exitCode !== null || child.signalCode !== null) return
        child.kill(sig)
        if (sig === 'SIGKILL') node.state = 'killed'
        else if (sig === 'SIGSTOP') node.state = 'stopped'
        else if (sig === 'SIGCONT' && node.state === 'stopped') node.state = 'up'
      },
      stop: async (graceMs = 15_000) => {
        if (child === undefined || child.exitCode !== null || child.signalCode !== null) return
        child.kill('SIGCONT')
        child.kill('SIGTERM')
        const c = child
        const t = setTimeout(() => { c.kill('SIGKILL') }, graceMs)
        await exit
        clearTimeout(t)
      },
    }
    return node
  })

  return {
    caDir,
    nodes,
    byName: name => {
      const n = nodes.find(x => x.spec.name === name)
      if (n === undefined) throw new Error(`no node named ${name}`)
      return n
    },
    start: async () => {
      // Ingresses first (everyone bootstraps to them), then the rest together.
      for (const n of nodes.filter(x => x.spec.api)) await n.start()
      await Promise.all(nodes.filter(x => !x.spec.api).map(async n => { await n.start() }))
    },
    stop: async () => {
      await Promise.all(nodes.map(async n => { await n.stop() }))
    },
  }
}
