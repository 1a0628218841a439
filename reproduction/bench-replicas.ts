/**
 * Replica scaling: aggregate decode throughput of N whole-model replicas (N = 1, 2, 4, 8, 16) in
 * one mesh, with `clients` concurrent streaming clients per node, (a) all through ONE node's HTTP
 * ingress and (b) spread over every node's ingress, measured side by side in one run. Reported:
 * aggregate tok/s, its ratio to N × one node's, and p50/p99 time to first token (client side).
 *
 * The engines are the SimulatedEngine (reproduction/simulated-engine.ts): fixed compute per token,
 * `slots` sequences batched per step, no weights, so the machine's cores do not cap the simulated
 * compute; everything else is the real thing: libp2p mesh (QUIC on loopback, CA admission, gossip,
 * load polling), the routed service (replica choice, /shoal/infer/1.0.0 forwarding), signed
 * receipts in a level log, the fastify ingress, SSE to real HTTP clients. The daemon has no seam
 * for a simulated engine yet, so each node is composed here from the public module APIs exactly
 * as daemon/node/daemon.ts composes it (createMesh + serveForwarded + createRoutedService +
 * withReceipts + createIngress). All nodes and clients share this ONE Node.js process.
 *
 * Optional (--real): 2 real onnxruntime nodes (`shoal node` child processes, each pinned to one
 * core with taskset) behind a model-less ingress, vs 1 such node, on a generated model.
 *
 * Run: node reproduction/bench-replicas.ts [--nodes 1,2,4,8,16] [--clients 10] [--ms-per-token 20]
 *        [--slots 10] [--max-tokens 64] [--warmup 2] [--measure 6] [--real] [--real-size small]
 */
import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { availableParallelism, loadavg, tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { createInterface } from 'node:readline'
import { setTimeout as sleep } from 'node:timers/promises'
import { parseArgs } from 'node:util'
import { Registry } from 'prom-client'
import { pino } from 'pino'
import { createThrowawayCa } from '../certs/index.ts'
import type { NodeIdentity } from '../certs/index.ts'
import { createIngress } from '../daemon/ingress/index.ts'
import type { Ingress } from '../daemon/ingress/index.ts'
import { createLedger } from '../daemon/ledger/index.ts'
import type { Ledger } from '../daemon/ledger/index.ts'
import { createMesh } from '../daemon/mesh/index.ts'
import type { Mesh } from '../daemon/mesh/index.ts'
import { createDaemon, serveForwarded, validateConfig, withReceipts } from '../daemon/node/index.ts'
// Internal to the daemon (not re-exported by daemon/node): the same candidate mapping it uses.
import { meshModelCards, replicaCandidates } from '../daemon/node/mesh-view.ts'
import { INFER_PROTOCOL, createRoutedService, forwardGenerate } from '../daemon/routing/index.ts'
import { compileShards, generateTestModel } from '../shards/index.ts'
import { createSimulatedEngine } from './simulated-engine.ts'
import { sseEvents } from './sse.ts'
import type { SimulatedEngine } from './simulated-engine.ts'
import { formatLoad, loadAverage, nearestRank } from './lib/index.ts'
import { execWithServeMalloc } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values } = parseArgs({
  options: {
    nodes: { type: 'string', default: '1,2,4,8,16' },
    clients: { type: 'string', default: '10' },
    'ms-per-token': { type: 'string', default: '20' },
    slots: { type: 'string', default: '10' },
    'max-tokens': { type: 'string', default: '64' },
    warmup: { type: 'string', default: '2' },
    measure: { type: 'string', default: '6' },
    real: { type: 'boolean', default: false },
    'real-size': { type: 'string', default: 'small' },
    'real-measure': { type: 'string', default: '15' },
  },
})
const NODE_COUNTS = values.nodes.split(',').map(Number)
const CLIENTS = Number(values.clients)
const MS_PER_TOKEN = Number(values['ms-per-token'])
const SLOTS = Number(values.slots)
const MAX_TOKENS = Number(values['max-tokens'])
const WARMUP_MS = Number(values.warmup) * 1000
const MEASURE_MS = Number(values.measure) * 1000
const MODEL = 'sim-model'
const LISTEN = ['/ip4/127.0.0.1/udp/0/quic-v1']
const silent = pino({ level: 'silent' })

// ---------------------------------------------------------------------------------------------
// One node, composed as daemon/node/daemon.ts does, with a SimulatedEngine as its local service.

interface BenchNode {
  peerId: string
  url: string
  addrs: string[]
  mesh: Mesh
  engine: SimulatedEngine
  stop (): Promise<void>
}

async function startBenchNode (identity: NodeIdentity, bootstrap: string[], dataDir: string): Promise<BenchNode> {
  const metrics = new Registry()
  const mesh = createMesh({ identity, listen: LISTEN, transports: ['quic'], bootstrap, mdns: false, dataDir }, { metrics })
  await mesh.start()
  const engine = createSimulatedEngine({ model: MODEL, nodeId: mesh.peerId, msPerToken: MS_PER_TOKEN, slots: SLOTS })
  await serveForwarded(mesh, engine, () => engine.load())
  const ledger: Ledger = createLedger({ dataDir, signer: { peerId: identity.peerId, secretKey: identity.secretKey, certificate: identity.certificate } }, { logger: silent })
  await ledger.start()
  const routed = createRoutedService({ localPeerId: mesh.peerId }, {
    local: engine,
    candidates: (model) => replicaCandidates(model, { peerId: mesh.peerId, serves: model === MODEL, load: engine.load() }, mesh.peers(), Date.now()),
    forward: (peerId, request, signal) => forwardGenerate(s => mesh.openStream(peerId, INFER_PROTOCOL, s), request, signal, { peerId }),
    meshModels: () => meshModelCards(mesh.peers()),
  })
  // The daemon's ingress admits 64 completions at once by default; the single-ingress runs need
  // up to clients × 16, so the bound is raised here (the daemon has no flag for it).
  const ingress: Ingress = createIngress({ host: '127.0.0.1', port: 0, logger: false, maxConcurrentRequests: 4096 },
    { service: withReceipts(routed, ledger), metrics, mesh: { snapshot: () => mesh.snapshot() } })
  const { url } = await ingress.start()
  mesh.setCapabilities({ models: [{ id: MODEL, maxContextTokens: 4096 }], engine: 'simulated', device: 'cpu', maxContextTokens: 4096, ingress: url, software: 'shoal/bench' })
  return {
    peerId: mesh.peerId,
    url,
    addrs: mesh.libp2p.getMultiaddrs().map(a => a.toString()),
    mesh,
    engine,
    async stop () {
      await ingress.stop()
      engine.stop()
      await mesh.stop()
      await ledger.stop()
    },
  }
}

// ---------------------------------------------------------------------------------------------
// Load generation: streaming HTTP clients, counting tokens as they arrive.

interface Window { start: number, end: number }
interface Tally { tokens: number, ttftMs: number[], errors: Map<string, number>, completed: number }

function newTally (): Tally { return { tokens: 0, ttftMs: [], errors: new Map(), completed: 0 } }

/** One client: back-to-back streaming completions until `stop` aborts. */
async function runClient (url: string, id: number, win: Window, tally: Tally, stop: AbortSignal, extra: Record<string, unknown> = {}): Promise<void> {
  for (let n = 0; !stop.aborted; n++) {
    const t0 = performance.now()
    try {
      const res = await fetch(`${url}/v1/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ model: MODEL, prompt: `client ${id} request ${n}: once upon a time`, max_tokens: MAX_TOKENS, temperature: 0, stream: true, ...extra }),
        signal: stop,
      })
      if (res.status !== 200) {
        const key = `HTTP ${res.status}`
        if (t0 >= win.start && t0 < win.end) tally.errors.set(key, (tally.errors.get(key) ?? 0) + 1)
        await res.text()
        await sleep(20, undefined, { signal: stop }).catch(() => {})
        continue
      }
      let first = true
      for await (const event of sseEvents(res.body)) {
        // A token chunk: a choice with text and no finish reason yet.
        if (!event.startsWith('data: {') || !event.includes('"finish_reason":null')) {
          if (event.includes('"error"') && t0 >= win.start && t0 < win.end) tally.errors.set('stream error', (tally.errors.get('stream error') ?? 0) + 1)
          continue
        }
        const now = performance.now()
        if (first) {
          first = false
          if (t0 >= win.start && t0 < win.end) tally.ttftMs.push(now - t0)
        }
        if (now >= win.start && now < win.end) tally.tokens++
      }
      if (performance.now() < win.end) tally.completed++
    } catch (err) {
      if (stop.aborted) return
      const key = (err as Error).name
      tally.errors.set(key, (tally.errors.get(key) ?? 0) + 1)
    }
  }
}

interface Result {
  label: string
  nodes: number
  clients: number
  tokPerSec: number
  p50: number
  p99: number
  errors: string
  /** Process CPU over the window, in cores (user + system). */
  cpuCores: number
  /** Share of completions per node, min–max, over the window. */
  spread: string
}

async function measure (label: string, nodes: BenchNode[], urls: string[], clientsPerUrl: number[]): Promise<Result> {
  const stop = new AbortController()
  const tally = newTally()
  const t = performance.now()
  const win: Window = { start: t + WARMUP_MS, end: t + WARMUP_MS + MEASURE_MS }
  let id = 0
  const clients: Array<Promise<void>> = []
  for (const [i, url] of urls.entries()) {
    for (let c = 0; c < clientsPerUrl[i]!; c++) clients.push(runClient(url, id++, win, tally, stop.signal))
  }
  await sleep(WARMUP_MS)
  const before = nodes.map(n => n.engine.stats().completed)
  const cpu0 = process.cpuUsage()
  await sleep(MEASURE_MS)
  const cpu = process.cpuUsage(cpu0)
  const done = nodes.map((n, i) => n.engine.stats().completed - before[i]!)
  stop.abort()
  await Promise.all(clients)
  // Let aborted forwards and streams settle before the next run.
  await sleep(300)
  const total = done.reduce((a, b) => a + b, 0)
  const shares = done.map(d => total === 0 ? 0 : d / total)
  return {
    label,
    nodes: nodes.length,
    clients: id,
    tokPerSec: tally.tokens / (MEASURE_MS / 1000),
    p50: nearestRank(tally.ttftMs, 0.5),
    p99: nearestRank(tally.ttftMs, 0.99),
    errors: tally.errors.size === 0 ? '0' : [...tally.errors].map(([k, v]) => `${k}×${v}`).join(' '),
    cpuCores: (cpu.user + cpu.system) / 1000 / MEASURE_MS,
    spread: nodes.length === 1 ? '100%' : `${(Math.min(...shares) * 100).toFixed(0)}–${(Math.max(...shares) * 100).toFixed(0)}%`,
  }
}

async function waitFullView (nodes: BenchNode[], boundMs = 120_000): Promise<void> {
  const until = Date.now() + boundMs
  const full = (n: BenchNode): boolean => n.mesh.peers().filter(p => p.state === 'alive' && p.load !== undefined && p.capabilities?.models.some(m => m.id === MODEL)).length === nodes.length - 1
  while (!nodes.every(full)) {
    if (Date.now() > until) throw new Error(`mesh of ${nodes.length} did not form within ${boundMs} ms`)
    await sleep(100)
  }
}

// ---------------------------------------------------------------------------------------------
// Optional: real onnxruntime nodes as child processes pinned to one core each.

const SHOAL_BIN = new URL('../scripts/shoal.mjs', import.meta.url).pathname

async function spawnNode (args: string[], cpu: number | undefined, cacheDir: string): Promise<{ child: ChildProcess, peerId: string, url?: string, addrs: string[] }> {
  const argv = [SHOAL_BIN, 'node', ...args, '--device', 'cpu', '--no-mdns', '--listen', '/ip4/127.0.0.1/udp/0/quic-v1']
  const [cmd, full] = cpu === undefined ? [process.execPath, argv] : ['taskset', ['-c', String(cpu), process.execPath, ...argv]]
  const child = spawn(cmd, full, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, SHOAL_CACHE: cacheDir } })
  let err = ''
  child.stderr!.on('data', (b: Buffer) => { err = (err + b.toString()).slice(-4000) })
  const lines = createInterface({ input: child.stdout! })
  return await new Promise((resolve, reject) => {
    let peerId: string | undefined
    let url: string | undefined
    const addrs: string[] = []
    const timer = setTimeout(() => { child.kill('SIGKILL'); reject(new Error(`node did not start: ${err}`)) }, 120_000)
    lines.on('line', line => {
      const up = /^shoal: node (\S+) up(?:, API at (\S+)\/v1)?/.exec(line)
      if (up !== null) { peerId = up[1]; url = up[2]; return }
      const l = /^\s+listening on (\S+)/.exec(line)
      if (l !== null && peerId !== undefined) {
        addrs.push(l[1]!)
        clearTimeout(timer)
        resolve({ child, peerId, ...(url === undefined ? {} : { url }), addrs })
      }
    })
    child.once('exit', code => { clearTimeout(timer); reject(new Error(`node exited (${code}): ${err}`)) })
  })
}

async function realRun (dir: string): Promise<Result[]> {
  const size = values['real-size'] as 'tiny' | 'small'
  const modelDir = join(dir, 'real-ckpt')
  const shardDir = join(dir, 'real-shard')
  await generateTestModel({ architecture: 'llama', size, outDir: modelDir, seed: 4, modelId: 'real-model' })
  await compileShards({ modelDir, outDir: shardDir })
  const ca = await createThrowawayCa(join(dir, 'real-pki'), ['ingress', 'r1', 'r2'])
  const cacheDir = join(dir, 'real-cache')
  const results: Result[] = []
  const measureMs = Number(values['real-measure']) * 1000
  // The ingress (no model) is an in-process daemon; its CPU is not the replicas' cores.
  const ingress = createDaemon(validateConfig({
    identityDir: ca.identities[0]!.dir, models: [], api: { host: '127.0.0.1', port: 0 }, device: 'cpu',
    dataDir: join(dir, 'real-data-ingress'), cacheRoot: cacheDir, listen: LISTEN, bootstrap: [], mdns: false,
  }), { logger: silent })
  const { apiUrl } = await ingress.start()
  const bootstrap = ingress.mesh!.libp2p.getMultiaddrs().map(a => a.toString())
  const children: ChildProcess[] = []
  try {
    for (const count of [1, 2]) {
      const started = await spawnNode(['--identity', ca.identities[count]!.dir, '--model', shardDir, '--data', join(dir, `real-data-${count}`), ...bootstrap.flatMap(b => ['--bootstrap', b])], count - 1, cacheDir)
      children.push(started.child)
      const until = Date.now() + 60_000
      while (ingress.mesh!.peers().filter(p => p.state === 'alive' && p.load !== undefined && p.capabilities?.models.some(m => m.id === 'real-model')).length < count) {
        if (Date.now() > until) throw new Error('real replicas did not join')
        await sleep(100)
      }
      const stop = new AbortController()
      const tally = newTally()
      const t = performance.now()
      const win: Window = { start: t + WARMUP_MS, end: t + WARMUP_MS + measureMs }
      const clients = Array.from({ length: CLIENTS }, async (_, i) => {
        await runRealClient(apiUrl!, i, win, tally, stop.signal)
      })
      await sleep(WARMUP_MS + measureMs)
      stop.abort()
      await Promise.all(clients)
      await sleep(500)
      results.push({
        label: `real onnxruntime (${size}), ${count} node(s) × 1 core, via a model-less ingress`,
        nodes: count,
        clients: CLIENTS,
        tokPerSec: tally.tokens / (measureMs / 1000),
        p50: nearestRank(tally.ttftMs, 0.5),
        p99: nearestRank(tally.ttftMs, 0.99),
        errors: tally.errors.size === 0 ? '0' : [...tally.errors].map(([k, v]) => `${k}×${v}`).join(' '),
        cpuCores: NaN,
        spread: '',
      })
    }
  } finally {
    for (const c of children) c.kill('SIGKILL')
    await ingress.stop()
  }
  return results
}

/** The real model's client: the same loop against the real model id. */
async function runRealClient (url: string, id: number, win: Window, tally: Tally, stop: AbortSignal): Promise<void> {
  await runClient(url, id, win, tally, stop, { model: 'real-model', prompt: `Client ${id} says: the quick brown fox` })
}

// ---------------------------------------------------------------------------------------------

const dir = await mkdtemp(join(tmpdir(), 'shoal-bench-replicas-'))
const results: Result[] = []
const load0 = loadavg()
const began = Date.now()
try {
  const max = Math.max(...NODE_COUNTS)
  const ca = await createThrowawayCa(join(dir, 'pki'), Array.from({ length: max }, (_, i) => `n${String(i).padStart(2, '0')}`))
  for (const n of NODE_COUNTS) {
    const nodes: BenchNode[] = []
    try {
      for (let i = 0; i < n; i++) {
        nodes.push(await startBenchNode(ca.identities[i]!, i === 0 ? [] : nodes[0]!.addrs, join(dir, `data-${n}-${i}`)))
      }
      await waitFullView(nodes)
      // Let the first load polls and capability records settle.
      await sleep(1000)
      const single = await measure(`(a) one ingress, ${n} node(s)`, nodes, [nodes[0]!.url], [CLIENTS * n])
      results.push(single)
      process.stderr.write(`${JSON.stringify(single)}\n`)
      if (n > 1) {
        const spread = await measure(`(b) every ingress, ${n} nodes`, nodes, nodes.map(x => x.url), nodes.map(() => CLIENTS))
        results.push(spread)
        process.stderr.write(`${JSON.stringify(spread)}\n`)
      }
    } finally {
      for (const node of [...nodes].reverse()) await node.stop().catch(() => {})
    }
  }
  if (values.real) {
    for (const r of await realRun(dir)) {
      results.push(r)
      process.stderr.write(`${JSON.stringify(r)}\n`)
    }
  }
} finally {
  await rm(dir, { recursive: true, force: true })
}

// ---------------------------------------------------------------------------------------------
// Report.

const base = results.find(r => r.nodes === 1 && r.label.startsWith('(a)'))
const fmt = (x: number, d = 0): string => Number.isFinite(x) ? x.toFixed(d) : '–'
const lines: string[] = []
lines.push(`Replica scaling — SimulatedEngine: ${MS_PER_TOKEN} ms/token, ${SLOTS} slots/node (ideal ${fmt(SLOTS * 1000 / MS_PER_TOKEN)} tok/s/node), ${CLIENTS} streaming clients per node, max_tokens ${MAX_TOKENS}; warmup ${WARMUP_MS / 1000} s, window ${MEASURE_MS / 1000} s`)
lines.push(`machine: ${availableParallelism()} cores, load average before ${formatLoad(load0)}, after ${loadAverage()}; Node ${process.version}; total ${((Date.now() - began) / 1000).toFixed(0)} s`)
lines.push('')
lines.push('| run | nodes | clients | tok/s | ÷ (N × one node) | TTFT p50 ms | TTFT p99 ms | completions per node (min–max share) | process CPU (cores) | errors |')
lines.push('|---|---:|---:|---:|---:|---:|---:|---|---:|---|')
for (const r of results.filter(x => !x.label.startsWith('real'))) {
  const ratio = base === undefined ? NaN : r.tokPerSec / (r.nodes * base.tokPerSec)
  lines.push(`| ${r.label} | ${r.nodes} | ${r.clients} | ${fmt(r.tokPerSec)} | ${fmt(ratio, 2)} | ${fmt(r.p50)} | ${fmt(r.p99)} | ${r.spread} | ${fmt(r.cpuCores, 2)} | ${r.errors} |`)
}
const real = results.filter(x => x.label.startsWith('real'))
if (real.length > 0) {
  const one = real.find(r => r.nodes === 1)
  lines.push('')
  lines.push('| real run | nodes | clients | tok/s | ÷ (N × one node) | TTFT p50 ms | TTFT p99 ms | errors |')
  lines.push('|---|---:|---:|---:|---:|---:|---:|---|')
  for (const r of real) lines.push(`| ${r.label} | ${r.nodes} | ${r.clients} | ${fmt(r.tokPerSec)} | ${fmt(one === undefined ? NaN : r.tokPerSec / (r.nodes * one.tokPerSec), 2)} | ${fmt(r.p50)} | ${fmt(r.p99)} | ${r.errors} |`)
}
process.stdout.write(lines.join('\n') + '\n')
