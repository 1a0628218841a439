/**
 * Mesh scale run: N mesh nodes (default 20) in this one process on loopback, no models. Every
 * node bootstraps to node 0 only; the rest of the mesh is found through capability gossip.
 * Measures time to full view (every node sees N−1 admitted, alive peers with capabilities and
 * load), gossip payload bytes received per node per second in steady state, load-protocol
 * frames per node per second, and CPU and memory per node. Default (production) timings.
 *
 * Run: node reproduction/mesh-scale.ts [--nodes 20] [--transport quic|tcp] [--steady 30] [--out FILE]
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { availableParallelism, tmpdir, cpus } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { setTimeout as sleep } from 'node:timers/promises'
import { parseArgs } from 'node:util'
import { createThrowawayCa } from '../certs/index.ts'
import { createMesh } from '../daemon/mesh/index.ts'
import type { Mesh, Transport } from '../daemon/mesh/index.ts'
import { loadAverage } from './lib/index.ts'

const { values } = parseArgs({
  options: {
    nodes: { type: 'string', default: '20' },
    transport: { type: 'string', default: 'quic' },
    steady: { type: 'string', default: '30' },
    out: { type: 'string' },
  },
})
const N = Number(values.nodes)
const transport = values.transport as Transport
const STEADY_S = Number(values.steady)
const FULL_VIEW_BOUND_MS = 120_000

const dir = await mkdtemp(join(tmpdir(), 'shoal-mesh-scale-'))
const names = Array.from({ length: N }, (_, i) => `n${String(i).padStart(2, '0')}`)
const ca = await createThrowawayCa(dir, names)

const gossipBytes = new Array<number>(N).fill(0)
const gossipMsgs = new Array<number>(N).fill(0)
const loadUpdates = new Array<number>(N).fill(0)
const meshes: Mesh[] = []
const refusals = new Map<string, number>()
const refusalLog = { info () {}, debug () {}, warn (o: object, msg?: string) { if (msg === 'mesh: peer refused') { const r = String((o as { reason?: string }).reason); refusals.set(r, (refusals.get(r) ?? 0) + 1) } } }
const listen = transport === 'quic' ? ['/ip4/127.0.0.1/udp/0/quic-v1'] : ['/ip4/127.0.0.1/tcp/0']

const cpu0 = process.cpuUsage()
const t0 = performance.now()
for (let i = 0; i < N; i++) {
  const bootstrap = i === 0 ? [] : [meshes[0]!.libp2p.getMultiaddrs()[0]!.toString()]
  const mesh = createMesh({ identity: ca.identities[i]!, listen, transports: [transport], bootstrap, mdns: false }, { logger: refusalLog })
  await mesh.start()
  mesh.setCapabilities({ models: [{ id: 'scale-model', layers: [0, 15], totalLayers: 32 }], engine: 'simulated', device: 'cpu' })
  mesh.setLoadProvider(() => ({ queueDepth: i % 3, inFlight: 1, decodeTokPerSec: 20, freeKvTokens: 4096, expectedWaitMs: 10 }))
  mesh.libp2p.services.pubsub.addEventListener('gossipsub:message', evt => {
    gossipBytes[i]! += evt.detail.msg.data.byteLength
    gossipMsgs[i]! += 1
  })
  mesh.onChange(c => { if (c.kind === 'load') loadUpdates[i]! += 1 })
  meshes.push(mesh)
}
const started = performance.now()

const fullView = (m: Mesh): boolean => m.peers().filter(p => p.state === 'alive' && p.capabilities !== undefined && p.load !== undefined).length === N - 1
let fullAt: number | undefined
while (performance.now() - started < FULL_VIEW_BOUND_MS) {
  if (meshes.every(fullView)) { fullAt = performance.now(); break }
  await sleep(100)
}
const cpuConverge = process.cpuUsage(cpu0)
const refusalsConverge = [...refusals.entries()].map(([r, n]) => `${r} ×${n}`).join(', ') || 'none'

// Steady state: count only what happens inside the window.
gossipBytes.fill(0); gossipMsgs.fill(0); loadUpdates.fill(0)
const cpu1 = process.cpuUsage()
const w0 = performance.now()
await sleep(STEADY_S * 1000)
const windowS = (performance.now() - w0) / 1000
const cpuSteady = process.cpuUsage(cpu1)
const rss = process.memoryUsage().rss
const connections = meshes.map(m => m.libp2p.getConnections().length)
const stillFull = meshes.filter(fullView).length

for (const m of meshes) await m.stop()
await rm(dir, { recursive: true, force: true })

const avg = (xs: number[]): number => xs.reduce((a, b) => a + b, 0) / xs.length
const f1 = (x: number): string => x.toFixed(1)
const lines = [
  `## ${N} nodes, ${transport}, one process (${new Date().toISOString().slice(0, 10)})`,
  '',
  `Command: \`node reproduction/mesh-scale.ts --nodes ${N} --transport ${transport} --steady ${STEADY_S}\``,
  `Machine: ${availableParallelism()} cores (${cpus()[0]?.model ?? 'unknown'}), load average before end ${loadAverage(2)}; Node ${process.version}. Default mesh timings (load every 500 ms, caps republish every 15 s).`,
  '',
  '| measure | value |',
  '|---|---|',
  `| nodes started (sequentially) in | ${f1((started - t0) / 1000)} s |`,
  `| time to full view after the last start | ${fullAt === undefined ? `not reached in ${FULL_VIEW_BOUND_MS / 1000} s` : `${f1((fullAt - started) / 1000)} s`} |`,
  `| time to full view from the first start | ${fullAt === undefined ? '—' : `${f1((fullAt - t0) / 1000)} s`} |`,
  `| nodes with full view at end of steady window | ${stillFull} / ${N} |`,
  `| connections per node (mean) | ${f1(avg(connections))} |`,
  `| gossip payload received per node, steady | ${f1(avg(gossipBytes) / windowS)} B/s (${f1(avg(gossipMsgs) / windowS)} msg/s) |`,
  `| load replies received per node, steady | ${f1(avg(loadUpdates) / windowS)} /s |`,
  `| CPU per node, steady | ${f1(100 * (cpuSteady.user + cpuSteady.system) / 1e6 / windowS / N)} % of one core |`,
  `| CPU per node, start to full view | ${f1(100 * (cpuConverge.user + cpuConverge.system) / 1e6 / ((fullAt ?? performance.now()) - t0) * 1000 / N)} % of one core |`,
  `| refusals while converging (all nodes) | ${refusalsConverge} |`,
  `| memory (RSS) per node | ${f1(rss / N / 2 ** 20)} MiB |`,
  '',
]
const text = lines.join('\n')
process.stdout.write(text + '\n')
if (values.out !== undefined) await writeFile(values.out, text + '\n')
