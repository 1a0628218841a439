/**
 * A two-stage chain through full daemons, as the chain speculation tests run it: a generated model
 * compiled in two stages; a local chain of the same stage graphs in one daemon, decoding plainly
 * (`--draft none`: the reference); node B holding stage 1 and node A holding stage 0 with the HTTP
 * ingress (A coordinates the chains), on loopback under a throwaway CA.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { pino } from 'pino'
import { createThrowawayCa } from '../../certs/index.ts'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { Daemon, DaemonConfig } from '../../daemon/node/index.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import type { CompileOptions, TestModelSize } from '../../shards/index.ts'
import { startInProcess } from './harness.ts'
import type { MeshNode } from './harness.ts'

export type ChainNode = MeshNode & { daemon: Daemon }

export interface ChainPair {
  localUrl: string
  a: ChainNode
  b: ChainNode
  stop (): Promise<void>
}

export async function startChainPair (o: {
  name: string, modelId: string, size: TestModelSize, seed: number, quant?: CompileOptions['quant'],
  a: Partial<DaemonConfig>, b: Partial<DaemonConfig>,
}): Promise<ChainPair> {
  const root = await mkdtemp(join(tmpdir(), `shoal-${o.name}-`))
  let local: Daemon | undefined
  const nodes: ChainNode[] = []
  const stop = async (): Promise<void> => {
    for (const n of nodes) await n.stop().catch(() => {})
    await local?.stop().catch(() => {})
    await rm(root, { recursive: true, force: true })
  }
  try {
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: 'llama', outDir: ckpt, size: o.size, seed: o.seed })
    const dir = join(root, 'two')
    const manifest = await compileShards({ modelDir: ckpt, outDir: dir, modelId: o.modelId, stages: 2, ...(o.quant === undefined ? {} : { quant: o.quant }) })
    const [layers0, layers1] = manifest.stages.map(st => st.layers as [number, number])
    local = createDaemon(validateConfig({
      models: [{ dir }], api: { host: '127.0.0.1', port: 0 }, device: 'cpu', draft: 'none',
      dataDir: join(root, 'local-data'), cacheRoot: join(root, 'cache'), listen: [], bootstrap: [], mdns: false, kvCacheMb: 0,
    }), { logger: pino({ level: 'silent' }) })
    const localUrl = (await local.start()).apiUrl!
    const ca = await createThrowawayCa(join(root, 'pki'), ['node-a', 'node-b'])
    const b = await startInProcess({ name: 'node-b', identityDir: ca.identities[1]!.dir, root, api: false, bootstrap: [], config: { ...o.b, models: [{ dir, layers: layers1! }] } }) as ChainNode
    nodes.push(b)
    const a = await startInProcess({ name: 'node-a', identityDir: ca.identities[0]!.dir, root, api: true, bootstrap: b.addrs, config: { ...o.a, models: [{ dir, layers: layers0! }] } }) as ChainNode
    nodes.push(a)
    return { localUrl, a, b, stop }
  } catch (err) {
    await stop()
    throw err
  }
}

export interface Completion { route: string, tokenIds: number[], receiptId: string, reused?: number }

/** A greedy completion of token ids, with the route, the token ids, the receipt id and the prefix reused. */
export async function complete (url: string, model: string, prompt: number[], maxTokens: number): Promise<Completion> {
  const res = await fetch(`${url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model, prompt, max_tokens: maxTokens, temperature: 0, return_token_ids: true }),
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
export async function speculationOf (url: string, receiptId: string): Promise<{ drafter: string, drafted: number, accepted: number } | undefined> {
  return (await (await fetch(`${url}/v1/receipts/${receiptId}`)).json() as { body: { speculation?: { drafter: string, drafted: number, accepted: number } } }).body.speculation
}
