/**
 * Issue 16, prefix-aware routing with real parts: three mesh daemons in this process (createDaemon
 * with an identity, as `shoal node` runs it) on loopback, each serving the `small` generated Llama
 * on onnxruntime with its prefix cache, and a `shoal serve`-style daemon with no prefix cache as the
 * cold reference. A multi-turn conversation sent to a different node every turn lands each
 * follow-up on the node that holds the previous turn's prompt KV, which prefills only what is new
 * (counted from its /metrics and its headers), and every turn's tokens equal the cold run's.
 *
 * Routing weighs the prefill a holder saves (at the measured prefill rate) against the hop, and
 * rightly stays local when that is a few milliseconds: the histories here are long enough, on a
 * model slow enough (`small`, not `tiny`), that the holder wins by far more than a loaded
 * machine's loopback RTT.
 */
import { join } from 'node:path'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createThrowawayCa } from '../../certs/index.ts'
import { blockHashes, compactHash, DEFAULT_BLOCK_SIZE, prefixScope } from '../../daemon/kv/index.ts'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { Daemon } from '../../daemon/node/index.ts'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { sees, startInProcess, waitFor } from './harness.ts'
import type { MeshNode } from './harness.ts'

type Node = MeshNode & { daemon: Daemon }

const MODEL_ID = 'small-prefix'
let ck: { root: string, shardDir: string, cleanup: () => Promise<void> }
let cold: { url: string, stop: () => Promise<void> }
let nodes: Node[] = []
/** The scope every node's cache hashes under (one manifest). */
let scope: string

interface Reply { route: string, reused: number, receipt: string, body: Record<string, any> }

async function post (url: string, path: string, body: unknown): Promise<Reply> {
  const res = await fetch(`${url}/v1/${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body), signal: AbortSignal.timeout(60_000) })
  const json = await res.json() as Record<string, any>
  if (res.status !== 200) throw new Error(`${path}: ${res.status} ${JSON.stringify(json)}`)
  return { route: res.headers.get('x-shoal-route')!, reused: Number(res.headers.get('x-shoal-prefix-reused') ?? 0), receipt: res.headers.get('x-shoal-receipt')!, body: json }
}

/** Prompt tokens a node prefilled so far (its prefix cache's miss counter). */
async function missTokens (url: string): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text()
  const m = new RegExp(`^shoal_kv_prefix_miss_tokens_total\\{model="${MODEL_ID}"\\} (\\d+)`, 'm').exec(text)
  return m === null ? 0 : Number(m[1])
}

/** Prefix summaries `holder`'s load replies carry, as `viewer` last heard them. */
function summaryOf (viewer: Node, holder: string): string[] {
  return viewer.daemon.mesh!.peers().find(p => p.peerId === holder)?.load?.prefixes ?? []
}

/** Waits until every other node's view of `holder`'s prefix summary satisfies `want`. */
async function heard (holder: string, want: (summary: string[]) => boolean): Promise<void> {
  await waitFor(`every node to hear ${holder.slice(-6)}'s new prefix`, () => nodes.filter(n => n.peerId !== holder).every(n => want(summaryOf(n, holder))), 20_000)
}

/** Deterministic pseudo-random token ids in [3, 500). */
function tokens (n: number, seed: number): number[] {
  let x = seed * 2654435761 >>> 0
  return Array.from({ length: n }, () => { x = (x * 1103515245 + 12345) >>> 0; return 3 + (x >>> 8) % 497 })
}

beforeAll(async () => {
  const root = await mkdtemp(join(tmpdir(), 'shoal-prefix-routing-'))
  await generateTestModel({ architecture: 'llama', size: 'small', outDir: join(root, 'ckpt'), modelId: MODEL_ID })
  await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard'), quant: 'none' })
  ck = { root, shardDir: join(root, 'shard'), cleanup: async () => { await rm(root, { recursive: true, force: true }) } }
  const daemon = createDaemon(validateConfig({
    models: [{ dir: ck.shardDir }], api: { host: '127.0.0.1', port: 0 }, device: 'cpu',
    dataDir: join(ck.root, 'cold-data'), cacheRoot: join(ck.root, 'cache'), listen: [], bootstrap: [], mdns: false,
    kvCacheMb: 0,
  }), { logger: pino({ level: 'silent' }) })
  const started = await daemon.start()
  cold = { url: started.apiUrl!, stop: async () => { await daemon.stop() } }

  const ca = await createThrowawayCa(join(ck.root, 'pki'), ['node-a', 'node-b', 'node-c'])
  const [a, b, c] = ca.identities
  const first = await startInProcess({ name: 'node-a', identityDir: a!.dir, root: ck.root, model: ck.shardDir, api: true, bootstrap: [] }) as Node
  nodes = [
    first,
    await startInProcess({ name: 'node-b', identityDir: b!.dir, root: ck.root, model: ck.shardDir, api: true, bootstrap: first.addrs }) as Node,
    await startInProcess({ name: 'node-c', identityDir: c!.dir, root: ck.root, model: ck.shardDir, api: true, bootstrap: first.addrs }) as Node,
  ]
  for (const n of nodes) {
    await waitFor(`${n.name} to see the others with the model`, async () => await sees(n.url!, nodes.filter(o => o !== n).map(o => o.peerId), MODEL_ID), 30_000)
  }
  const served = nodes[1]!.daemon.mesh!.peers().find(p => p.peerId === nodes[0]!.peerId)!.capabilities!.models.find(m => m.id === MODEL_ID)!
  scope = prefixScope({ manifestHash: served.manifestHash!, layers: [0, served.totalLayers! - 1], dtype: 'float32' })
})

afterAll(async () => {
  for (const n of [...nodes].reverse()) await n.stop().catch(() => {})
  await cold?.stop()
  await ck?.cleanup()
})

describe('prefix-aware routing across three replicas', () => {
  it('each turn of a token conversation, sent to another node, runs where the last turn\'s prompt KV is, prefills only its new tokens, and equals a cold run', async () => {
    let prompt = tokens(900, 1)
    let holder: string | undefined
    let previous: number[] = []
    for (let turn = 0; turn < 4; turn++) {
      const entry = nodes[turn % nodes.length]!
      const before = holder === undefined ? 0 : await missTokens(nodes.find(n => n.peerId === holder)!.url!)
      const request = { model: MODEL_ID, prompt, max_tokens: 12, temperature: 0, return_token_ids: true }
      const r = await post(entry.url!, 'completions', request)
      const reference = await post(cold.url, 'completions', request)
      const ids = r.body.choices[0].token_ids as number[]
      expect(ids).toEqual(reference.body.choices[0].token_ids)
      expect(reference.reused).toBe(0)
      if (holder === undefined) {
        // Nobody holds any of it: the idle entry node serves it itself.
        expect(r.route).toBe(entry.peerId)
        expect(r.reused).toBe(0)
      } else {
        expect(r.route).toBe(holder)
        // Everything of the last prompt came from the cache; what runs is the last reply and the new message.
        expect(r.reused).toBe(previous.length)
        const prefilled = await missTokens(nodes.find(n => n.peerId === holder)!.url!) - before
        expect(prefilled).toBe(prompt.length - previous.length)
        // The receipt on the entry node says so too.
        const receipt = await (await fetch(`${entry.url!}/v1/receipts/${r.receipt}`)).json() as { body: { prefix?: unknown } }
        expect(receipt.body.prefix).toEqual({ peerId: holder, reusedTokens: previous.length })
      }
      holder = r.route
      // Wait (bounded) for the holder's load replies to list this prompt's deepest block.
      const deepest = compactHash(blockHashes(scope, prompt, DEFAULT_BLOCK_SIZE).at(-1)!)
      await heard(holder, s => s.includes(deepest))
      previous = prompt
      prompt = [...prompt, ...ids, ...tokens(20, 100 + turn)]
    }
    // The entry nodes of turns 1 and 2 count their decisions on /metrics: sent to the holder.
    for (const n of nodes.slice(1)) {
      expect(await (await fetch(`${n.url!}/metrics`)).text()).toMatch(/^shoal_routing_prefix_requests_total\{outcome="holder"\} [1-9]/m)
    }
  })

  it('a chat conversation (tokenized by the entry node\'s own tokenizer) follows its prefix too, and each reply equals a cold run', async () => {
    // A long system prompt (see above: a short history is rightly not worth a hop).
    const messages: Array<{ role: string, content: string }> = [
      { role: 'system', content: 'You are a careful assistant. Answer every question about the weather, the sea and the tides in one short paragraph, and say which harbour you mean. '.repeat(24) },
      { role: 'user', content: 'What is the tide doing at the north harbour this evening?' },
    ]
    let holder: string | undefined
    for (let turn = 0; turn < 3; turn++) {
      const entry = nodes[(turn + 1) % nodes.length]!
      const request = { model: MODEL_ID, messages, max_tokens: 10, temperature: 0 }
      // What each node has heard of each other's prefixes before this turn.
      const seen = new Map(nodes.flatMap(v => nodes.filter(o => o !== v).map(o => [`${v.peerId}>${o.peerId}`, summaryOf(v, o.peerId).join()] as const)))
      const r = await post(entry.url!, 'chat/completions', request)
      const reference = await post(cold.url, 'chat/completions', request)
      expect(r.body.choices[0].message.content).toBe(reference.body.choices[0].message.content)
      if (holder === undefined) {
        expect(r.route).toBe(entry.peerId)
      } else {
        expect(r.route).toBe(holder)
        expect(r.reused).toBeGreaterThan(0)
        expect(r.body.shoal.prefix_reused_tokens).toBe(r.reused)
      }
      holder = r.route
      const h = holder
      await waitFor('the others to hear the holder\'s new prefix', () => nodes.filter(n => n.peerId !== h).every(n => summaryOf(n, h).join() !== seen.get(`${n.peerId}>${h}`)), 20_000)
      messages.push({ role: 'assistant', content: r.body.choices[0].message.content as string }, { role: 'user', content: `And at the south harbour, turn ${turn + 2}?` })
    }
  })
})
