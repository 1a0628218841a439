/**
 * KV mobility: time to first token (TTFT) of a follow-up turn whose prompt is a long history (the
 * previous turn's prompt and reply) plus a short new message, three ways —
 *   local hit  the node that served turn 1 runs turn 2 from the prefix it kept;
 *   pulled     another node runs turn 2: it pulls the history's KV from the first over
 *              /shoal/kv/1.0.0 (real libp2p nodes on loopback, TCP + noise + yamux) and prefills
 *              only the rest;
 *   recomputed a node without the prefix prefills everything.
 * The puller's link gets a simulated one-way latency per hop (`--delays`, the pipeline's delay-line
 * idea: each direction's messages arrive that much later, in order) and optionally a bandwidth cap
 * (`--bandwidth` bytes/s: messages are also spaced by their size over it). The request's own hop
 * from the ingress is the same for all three and left out. Every follow-up's greedy tokens are
 * checked against the recomputed one's. The cost model's verdict (shouldPull, with the rates
 * measured here) is printed beside each row.
 *
 * Then the routed path through real daemons (`--routed-rounds`, 0 skips it): two mesh daemons
 * (createDaemon with identities, libp2p on loopback) serve the model; turn 1 enters at A, turn 2
 * at B, whose `routing.prefix` never prefers the holder, so B runs it and — on the hint routing
 * gives it and its own pull decision (no policy override here) — pulls the history from A. Beside
 * it, the same follow-up entering at A (a local hit) and at a daemon without a prefix cache
 * (recomputed), all three streamed over HTTP (TTFT to the first token event).
 *
 *   node reproduction/bench-kv-move.ts [--size 60m] [--quant int4] [--history 2000] [--new 20] [--rounds 2] [--delays 0,20,100] [--bandwidth B] [--threads 1] [--routed-rounds 1]
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { cpus, tmpdir } from 'node:os'
import { join } from 'node:path'
import { parseArgs } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import type { Libp2p, Stream } from '@libp2p/interface'
import { tcp } from '@libp2p/tcp'
import { createLibp2p } from 'libp2p'
import { createThrowawayCa } from '../certs/index.ts'
import { createLocalService } from '../daemon/engine/index.ts'
import type { LocalService } from '../daemon/engine/index.ts'
import { blockHashes, compactHash, createKvPuller, DEFAULT_BLOCK_SIZE, kvBytesPerToken, prefixScope, pullCost, serveKv, shouldPull } from '../daemon/kv/index.ts'
import type { PullOutcome } from '../daemon/kv/index.ts'
import type { Daemon, DaemonConfig } from '../daemon/node/index.ts'
import type { GenerateRequest, PrefixHolderHint } from '../daemon/service.ts'
import { compileShards, generateTestModel, manifestHash } from '../shards/index.ts'
import type { TestModelSize } from '../shards/testmodel/generate.ts'
import { tokenChunks } from './sse.ts'
import { benchDaemon, lcgTokens, loadAverage, lowerMedian } from './lib/index.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    size: { type: 'string', default: '60m' },
    quant: { type: 'string', default: 'int4' },
    history: { type: 'string', default: '2000' },
    new: { type: 'string', default: '20' },
    rounds: { type: 'string', default: '2' },
    delays: { type: 'string', default: '0,20,100' },
    bandwidth: { type: 'string' },
    threads: { type: 'string', default: '1' },
    'routed-rounds': { type: 'string', default: '1' },
  },
})
const ROUTED_ROUNDS = Number(args['routed-rounds'])
const HISTORY = Number(args.history)
const NEW = Number(args.new)
const ROUNDS = Number(args.rounds)
const DELAYS = args.delays.split(',').map(Number)
const BANDWIDTH = args.bandwidth === undefined ? undefined : Number(args.bandwidth)
const threads = Number(args.threads)

/**
 * One direction of a simulated link: each message is delivered `ms` after it would have finished
 * crossing a link of `bytesPerSecond` (unlimited when undefined), in order.
 */
function createLink (ms: number, bytesPerSecond: number | undefined): (bytes: number, deliver: () => void) => void {
  let free = 0
  let last = 0
  return (bytes, deliver) => {
    const now = performance.now()
    const sent = bytesPerSecond === undefined ? now : Math.max(free, now) + bytes / bytesPerSecond * 1000
    free = sent
    // Never before an earlier message (timers of equal delay fire in order; this keeps it so).
    const at = Math.max(last, sent + ms)
    last = at
    if (at - now <= 0.5) deliver()
    else setTimeout(deliver, at - now)
  }
}

/** A stream whose incoming messages and end/close events, and outgoing sends, cross simulated links. */
function delayed (stream: Stream, ms: number, bytesPerSecond: number | undefined): Stream {
  if (ms <= 0 && bytesPerSecond === undefined) return stream
  const inbound = createLink(ms, bytesPerSecond)
  const outbound = createLink(ms, bytesPerSecond)
  type Listener = (evt: Event) => void
  const wrapped = new Map<unknown, Listener>()
  return new Proxy(stream, {
    get (target, prop) {
      if (prop === 'addEventListener') {
        return (type: string, listener: Listener, options?: { once?: boolean }) => {
          const w: Listener = (evt) => {
            const size = type === 'message' ? (evt as unknown as { data: { byteLength: number } }).data.byteLength : 0
            inbound(size, () => listener(evt))
          }
          wrapped.set(listener, w)
          target.addEventListener(type as 'message', w as never, options)
        }
      }
      if (prop === 'removeEventListener') {
        return (type: string, listener: Listener) => { target.removeEventListener(type as 'message', (wrapped.get(listener) ?? listener) as never) }
      }
      if (prop === 'send') {
        // The bytes are queued on the link and sent when they would have crossed it; the caller sees no back-pressure.
        return (data: { byteLength: number }) => { outbound(data.byteLength, () => { if (target.writeStatus === 'writable') target.send(data as never) }); return true }
      }
      const v = Reflect.get(target, prop, target) as unknown
      return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v
    },
  })
}

async function node (): Promise<Libp2p> {
  return await createLibp2p({
    addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
    transports: [tcp()],
    connectionEncrypters: [noise()],
    streamMuxers: [yamux()],
    connectionMonitor: { enabled: false },
  })
}

let counter = 0
async function turn (svc: LocalService, ids: number[], maxTokens: number, hint?: PrefixHolderHint): Promise<{ ttftMs: number, tokens: number[], prefix: string | undefined }> {
  const req: GenerateRequest = {
    requestId: `k${++counter}`, model: 'bench', prompt: { kind: 'tokens', ids }, maxTokens, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 600_000,
    ...(hint === undefined ? {} : { prefixHolder: hint }),
  }
  const t0 = performance.now()
  let ttft = 0
  let prefix: string | undefined
  const out: number[] = []
  for await (const ev of svc.generate(req, new AbortController().signal)) {
    if (ev.type === 'start') prefix = ev.prefix === undefined ? undefined : ev.prefix.movedFrom === undefined ? 'reused' : 'moved'
    if (ev.type === 'delta') { if (ttft === 0) ttft = performance.now() - t0; out.push(...ev.tokenIds) }
  }
  return { ttftMs: ttft, tokens: out, prefix }
}

interface Routed { ttftMs: number, tokens: number[], route: string, reused: number, movedFrom: string | null }

/** One streamed completion over HTTP: TTFT to the first event with token ids, the headers' prefix. */
async function streamed (url: string, prompt: number[], maxTokens: number): Promise<Routed> {
  const t0 = performance.now()
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'bench', prompt, max_tokens: maxTokens, temperature: 0, stream: true, return_token_ids: true }),
    signal: AbortSignal.timeout(600_000),
  })
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`)
  let ttftMs = 0
  const out: number[] = []
  for await (const { ids: got, at } of tokenChunks(res.body, url)) {
    if (ttftMs === 0) ttftMs = at - t0
    out.push(...got)
  }
  return { ttftMs, tokens: out, route: res.headers.get('x-shoal-route') ?? '', reused: Number(res.headers.get('x-shoal-prefix-reused') ?? 0), movedFrom: res.headers.get('x-shoal-prefix-moved-from') }
}

async function metricOf (url: string, line: string): Promise<number> {
  const found = (await (await fetch(`${url}/metrics`)).text()).split('\n').find(l => l.startsWith(line))
  return found === undefined ? 0 : Number(found.split(' ').pop())
}

/**
 * The routed path through real daemons: A keeps turn 1, B gets turn 2 (its routing.prefix never
 * prefers the holder), pulls from A on routing's hint and its own cost model.
 */
async function routedRounds (dir: string, shardDir: string, vocab: number, stops: Array<() => Promise<void>>): Promise<void> {
  const ca = await createThrowawayCa(join(dir, 'pki'), ['a', 'b'])
  const start = async (name: string, over: Partial<DaemonConfig>): Promise<{ daemon: Daemon, peerId: string, url: string }> => {
    const daemon = benchDaemon(shardDir, dir, { kvCacheMb: 2048, ...over }, { name, log: 'silent' })
    const { peerId, apiUrl } = await daemon.start()
    stops.push(async () => { await daemon.stop() })
    return { daemon, peerId, url: apiUrl! }
  }
  const cold = await start('cold', { kvCacheMb: 0 })
  const a = await start('a', { identityDir: ca.identities[0]!.dir, listen: ['/ip4/127.0.0.1/tcp/0'] })
  const b = await start('b', {
    identityDir: ca.identities[1]!.dir, listen: ['/ip4/127.0.0.1/tcp/0'],
    bootstrap: a.daemon.mesh!.libp2p.getMultiaddrs().map(x => x.toString()),
    routing: { prefix: { minSavedMs: 1e12 } },
  })
  const deadline = Date.now() + 60_000
  const view = (from: typeof a, of: typeof a) => from.daemon.mesh!.peers().find(p => p.peerId === of.peerId)
  while (![[a, b], [b, a]].every(([x, y]) => view(x!, y!)?.state === 'alive' && view(x!, y!)?.load !== undefined && view(x!, y!)?.capabilities?.models.some(m => m.id === 'bench') === true)) {
    if (Date.now() > deadline) throw new Error('the mesh did not form within 60 s')
    await sleep(200)
  }
  const scope = prefixScope({ manifestHash: await manifestHash(shardDir), layers: [0, view(b, a)!.capabilities!.models.find(m => m.id === 'bench')!.totalLayers! - 1], dtype: 'float32' })
  // Warm every engine (JIT, sessions) untimed; B and the cold node measure their prefill speed.
  for (const n of [a, b, cold]) await streamed(n.url, lcgTokens(Math.min(HISTORY, 512), 5, vocab), 2)
  const line = (url: string, name: string, labels: string): Promise<number> => metricOf(url, `${name}{${labels}}`)
  console.log(`\n### Routed through daemons (loopback TCP mesh, no simulated delay): turn 1 enters at A, the follow-up at B; load average ${loadAverage()}`)
  console.log('\n| round | local hit at A TTFT (ms) | routed to B, pulled TTFT (ms) | recomputed TTFT (ms) | x-shoal-prefix-reused / moved-from | B pulls ok / fallback | moved (MB) | tokens identical |')
  console.log('|---|---|---|---|---|---|---|---|')
  for (let r = 0; r < ROUTED_ROUNDS; r++) {
    const history = lcgTokens(HISTORY, 500 + r, vocab)
    const first = await streamed(a.url, history, 8)
    const deepest = compactHash(blockHashes(scope, history, DEFAULT_BLOCK_SIZE).at(-1)!)
    const heard = Date.now() + 20_000
    while (!(view(b, a)?.load?.prefixes ?? []).includes(deepest)) {
      if (Date.now() > heard) throw new Error('B did not hear A\'s prefix within 20 s')
      await sleep(100)
    }
    const follow = [...history, ...first.tokens, ...lcgTokens(NEW, 800 + r, vocab)]
    const before = { ok: await line(b.url, 'shoal_kv_pulls_total', 'model="bench",outcome="ok"'), fb: await line(b.url, 'shoal_kv_pulls_total', 'model="bench",outcome="fallback"'), in: await line(b.url, 'shoal_kv_transfer_bytes_total', 'model="bench",direction="in"') }
    // Routed first, while A keeps exactly the history (its own hit would supersede it).
    const p = await streamed(b.url, follow, 8)
    const h = await streamed(a.url, follow, 8)
    const c = await streamed(cold.url, follow, 8)
    const ok = await line(b.url, 'shoal_kv_pulls_total', 'model="bench",outcome="ok"') - before.ok
    const fb = await line(b.url, 'shoal_kv_pulls_total', 'model="bench",outcome="fallback"') - before.fb
    const bytes = await line(b.url, 'shoal_kv_transfer_bytes_total', 'model="bench",direction="in"') - before.in
    const same = JSON.stringify(p.tokens) === JSON.stringify(c.tokens) && JSON.stringify(h.tokens) === JSON.stringify(c.tokens)
    const moved = p.movedFrom === a.peerId ? 'A' : String(p.movedFrom)
    console.log(`| ${r + 1} | ${h.ttftMs.toFixed(0)} | ${p.ttftMs.toFixed(0)} (route ${p.route === b.peerId ? 'B' : p.route}) | ${c.ttftMs.toFixed(0)} | ${p.reused} / ${moved} | ${ok} / ${fb} | ${(bytes / 1e6).toFixed(1)} | ${same ? 'yes' : 'NO'} |`)
  }
}

const dir = await mkdtemp(join(tmpdir(), 'shoal-bench-kv-move-'))
const stops: Array<() => Promise<void>> = []
try {
  await generateTestModel({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: args.size as TestModelSize })
  const manifest = await compileShards({ modelDir: join(dir, 'ckpt'), outDir: join(dir, 'shard'), modelId: 'bench', quant: args.quant as 'none' | 'int8' | 'int4' })
  const common = { shardDir: join(dir, 'shard'), threads, maxSequences: 4, manifestHash: 'bench-manifest' }
  const holderNode = await node()
  const pullerNode = await node()
  stops.push(async () => { await pullerNode.stop(); await holderNode.stop() })
  let delayMs = 0
  let lastPull: PullOutcome | undefined
  const holder = createLocalService({ ...common, kvCacheBytes: 2 * 1024 ** 3 })
  const cold = createLocalService({ ...common, kvCacheBytes: 0 })
  let pullerService: LocalService | undefined
  const puller = createKvPuller({}, {
    openStream: async (_peer, protocol, signal) => delayed(await pullerNode.dialProtocol(holderNode.getMultiaddrs(), protocol, { signal }), delayMs, BANDWIDTH),
    store: () => pullerService?.kvStore,
  })
  pullerService = createLocalService({
    ...common,
    kvCacheBytes: 2 * 1024 ** 3,
    pullPrefix: async (a) => { lastPull = await puller.pull({ ...a, model: 'bench' }); return lastPull },
    // Measure the pull whatever the cost model says (its verdict is printed beside it).
    pullPolicy: () => true,
  })
  for (const s of [holder, cold, pullerService]) { await s.start(); stops.push(async () => { await s.stop() }) }
  const server = await serveKv({ stores: () => [holder.kvStore!] }, {
    handle: async (p, h) => { await holderNode.handle(p, h) },
    openStream: async () => { throw new Error('the holder opens nothing') },
  })
  stops.push(async () => { await server.stop() })
  const info = holder.kvStore!.info()
  const bytesPerToken = kvBytesPerToken(info)
  const vocab = manifest.shape.vocabSize
  console.log(`## ${args.size} ${args.quant}: follow-up after a ${HISTORY}-token history (+8-token reply, +${NEW} new); ${bytesPerToken} KV bytes/token; threads ${threads}; bandwidth ${BANDWIDTH === undefined ? 'uncapped' : `${BANDWIDTH} B/s`}; ${cpus().length} cores (${cpus()[0]?.model ?? '?'}); load average ${loadAverage()}; malloc: ${mallocSettings()}`)
  console.log('\n| one-way delay per hop (ms) | local hit TTFT p50 (ms) | pulled TTFT p50 (ms) | recomputed TTFT p50 (ms) | moved (MB) | pull time p50 (ms) | link (MB/s) | shouldPull (measured rates) | tokens identical |')
  console.log('|---|---|---|---|---|---|---|---|---|')
  // A mesh keeps its connections up: dial once, and warm every path (JIT, sessions) with one untimed round.
  await pullerNode.dial(holderNode.getMultiaddrs())
  {
    const warm = lcgTokens(Math.min(HISTORY, 256), 7, vocab)
    await turn(holder, warm, 2)
    await turn(pullerService, [...warm, ...lcgTokens(8, 8, vocab)], 2, { peerId: holderNode.peerId.toString(), cachedTokens: warm.length })
    await turn(cold, warm, 2)
    // The puller knows its own prefill speed (it bounds how long a pull may take).
    await turn(pullerService, lcgTokens(Math.min(HISTORY, 512), 9, vocab), 2)
  }
  let seed = 0
  for (const d of DELAYS) {
    delayMs = d
    const hit: number[] = []
    const pulled: number[] = []
    const recomputed: number[] = []
    const pullMs: number[] = []
    let moved = 0
    let same = 0
    let verdict = ''
    for (let r = 0; r < ROUNDS; r++) {
      seed++
      const history = lcgTokens(HISTORY, 100 + seed, vocab)
      const first = await turn(holder, history, 8)
      const follow = [...history, ...first.tokens, ...lcgTokens(NEW, 900 + seed, vocab)]
      // Pulled first, while the holder keeps exactly the history (its hit would supersede it).
      lastPull = undefined
      const p = await turn(pullerService, follow, 8, { peerId: holderNode.peerId.toString(), cachedTokens: HISTORY })
      if (lastPull === undefined || !(lastPull as PullOutcome).ok || p.prefix !== 'moved') throw new Error(`round ${r}: the pull did not happen: ${JSON.stringify(lastPull)}`)
      const ok = lastPull as Extract<PullOutcome, { ok: true }>
      const h = await turn(holder, follow, 8)
      const c = await turn(cold, follow, 8)
      if (JSON.stringify(p.tokens) === JSON.stringify(c.tokens) && JSON.stringify(h.tokens) === JSON.stringify(c.tokens)) same++
      hit.push(h.ttftMs)
      pulled.push(p.ttftMs)
      recomputed.push(c.ttftMs)
      pullMs.push(ok.ms)
      moved = ok.bytes
      const rates = { tokens: ok.tokens, bytesPerToken, linkBytesPerSecond: ok.bytes / (ok.ms - 2 * d) * 1000, rttMs: 2 * d, prefillTokensPerSecond: follow.length / c.ttftMs * 1000 }
      const cost = pullCost(rates)
      verdict = `${shouldPull(rates) ? 'pull' : 'recompute'} (${cost.transferMs.toFixed(0)} vs ${cost.recomputeMs.toFixed(0)} ms)`
    }
    const link = moved / 1e6 / ((lowerMedian(pullMs) - 2 * d) / 1000)
    console.log(`| ${d} | ${lowerMedian(hit).toFixed(0)} | ${lowerMedian(pulled).toFixed(0)} | ${lowerMedian(recomputed).toFixed(0)} | ${(moved / 1e6).toFixed(1)} | ${lowerMedian(pullMs).toFixed(0)} | ${link.toFixed(0)} | ${verdict} | ${same}/${ROUNDS} |`)
  }
  // The in-process services are done: free their CPU for the daemons.
  for (const stop of stops.splice(0).reverse()) await stop().catch(() => {})
  if (ROUTED_ROUNDS > 0) await routedRounds(dir, join(dir, 'shard'), vocab, stops)
} finally {
  for (const stop of stops.reverse()) await stop().catch(() => {})
  await rm(dir, { recursive: true, force: true })
}
