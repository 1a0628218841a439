/**
 * Prompt lookup on by default on a chain's stage 0, through full daemons, beside the chain's KV
 * prefix reuse (wave 39): A holds stage 0 of an fp32 model and coordinates without `--draft`, B
 * holds stage 1; both keep prefixes. Until wave 39 a chain coordinator got no default lookup,
 * because a source wrapper turned its chains' prefix reuse off; now a speculating request prefills
 * through the chain from a kept prefix like any other, and keeps its prompt for the next one.
 * Greedy tokens equal a local chain's decoding plainly (`--draft none`), the receipt names the
 * default drafter and counts drafts verified, and a repeated prompt opens every stage from the
 * kept prefix.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createThrowawayCa } from '../../certs/index.ts'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { Daemon } from '../../daemon/node/index.ts'
import { DEFAULT_LOOKUP_NAME } from '../../daemon/speculative/index.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { startInProcess, waitFor } from './harness.ts'
import type { MeshNode } from './harness.ts'

type Node = MeshNode & { daemon: Daemon }

const MODEL_ID = 'chain-fp32'
// Token ids that repeat, so prompt lookup has drafts to verify.
const PROMPT = Array.from({ length: 48 }, (_, i) => 3 + (i % 6) * 41)

interface Completion { route: string, tokenIds: number[], receiptId: string, reused?: number }

async function complete (url: string): Promise<Completion> {
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL_ID, prompt: PROMPT, max_tokens: 48, temperature: 0, return_token_ids: true }),
    signal: AbortSignal.timeout(120_000),
  })
  const json = await res.json() as Record<string, any>
  if (res.status !== 200) throw new Error(`completions: ${res.status} ${JSON.stringify(json)}`)
  return {
    route: res.headers.get('x-shoal-route')!,
    tokenIds: json.choices[0].token_ids as number[],
    receiptId: json.shoal.receipt_id as string,
    ...(json.shoal.prefix_reused_tokens === undefined ? {} : { reused: json.shoal.prefix_reused_tokens as number }),
  }
}

/** What the request's signed receipt says speculation did (absent: it decoded plainly). */
async function speculationOf (url: string, receiptId: string): Promise<{ drafter: string, drafted: number } | undefined> {
  return (await (await fetch(`${url}/v1/receipts/${receiptId}`)).json() as { body: { speculation?: { drafter: string, drafted: number } } }).body.speculation
}

describe('default prompt lookup on a chain coordinator, with prefix reuse, through daemons', () => {
  let root: string
  let local: Daemon
  let localUrl = ''
  let a: Node
  let b: Node

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-chain-default-'))
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: 'llama', outDir: ckpt, size: 'tiny', seed: 9 })
    const dir = join(root, 'two')
    const manifest = await compileShards({ modelDir: ckpt, outDir: dir, modelId: MODEL_ID, stages: 2 })
    const [layers0, layers1] = manifest.stages.map(st => st.layers as [number, number])
    // The reference: the same two stage graphs as a local chain in one daemon, decoding plainly.
    local = createDaemon(validateConfig({
      models: [{ dir }], api: { host: '127.0.0.1', port: 0 }, device: 'cpu', draft: 'none',
      dataDir: join(root, 'local-data'), cacheRoot: join(root, 'cache'), listen: [], bootstrap: [], mdns: false, kvCacheMb: 0,
    }), { logger: pino({ level: 'silent' }) })
    localUrl = (await local.start()).apiUrl!
    const ca = await createThrowawayCa(join(root, 'pki'), ['node-a', 'node-b'])
    b = await startInProcess({ name: 'node-b', identityDir: ca.identities[1]!.dir, root, api: false, bootstrap: [], config: { models: [{ dir, layers: layers1! }], kvCacheMb: 16 } }) as Node
    a = await startInProcess({ name: 'node-a', identityDir: ca.identities[0]!.dir, root, api: true, bootstrap: b.addrs, config: { models: [{ dir, layers: layers0! }], kvCacheMb: 16 } }) as Node
    await waitFor('A to see B holding stage 1', () => a.daemon.mesh!.peers().some(p => p.peerId === b.peerId && p.state === 'alive' &&
      p.capabilities?.models.some(m => m.id === MODEL_ID) === true), 30_000)
  }, 300_000)

  afterAll(async () => {
    for (const n of [a, b]) await n?.stop().catch(() => {})
    await local?.stop().catch(() => {})
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('drafts over the chain A → B with the local chain\'s tokens, and a repeated prompt reuses the kept prefix', async () => {
    const want = (await complete(localUrl)).tokenIds
    const first = await complete(a.url!)
    expect(first.route.split(',')).toEqual([a.peerId, b.peerId])
    expect(first.tokenIds).toEqual(want)
    expect(first.reused).toBeUndefined()
    const spec = await speculationOf(a.url!, first.receiptId)
    expect(spec?.drafter).toBe(DEFAULT_LOOKUP_NAME)
    expect(spec!.drafted).toBeGreaterThan(0)
    // A's capabilities declare the default drafter for the model requests enter by; B's stage none.
    const declared = (n: Node): string | undefined => n.daemon.mesh!.peers().find(p => p.peerId === (n === a ? b : a).peerId)?.capabilities?.models.find(m => m.id === MODEL_ID)?.drafter
    await waitFor('B to see A declare the default drafter', () => declared(b) === DEFAULT_LOOKUP_NAME, 30_000)
    expect(declared(a)).toBeUndefined()

    const again = await complete(a.url!)
    expect(again.tokenIds).toEqual(want)
    expect(again.reused).toBeGreaterThan(0)
    expect((await speculationOf(a.url!, again.receiptId))?.drafter).toBe(DEFAULT_LOOKUP_NAME)
  }, 120_000)
})
