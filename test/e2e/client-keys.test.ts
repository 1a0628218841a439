/**
 * `shoal serve --require-keys --ca FILE --revocations FILE` wired end to end: the real daemon with
 * the tiny model, a CA directory made by the real CA code, keys from `issueKey`, the real openai
 * client. A key revoked in the list given at start is refused; the receipt names the key.
 */
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import OpenAI, { AuthenticationError } from 'openai'
import { pino } from 'pino'
import { initCa, issueKey, revokeNode } from '../../certs/index.ts'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import { MODEL_ID, makeTinyCheckpoint } from './daemon.ts'
import type { TinyCheckpoint } from './daemon.ts'

let ck: TinyCheckpoint
let stop: (() => Promise<void>) | undefined
let url: string
let alice: string
let mallory: string

beforeAll(async () => {
  ck = await makeTinyCheckpoint({ compile: false })
  const caDir = join(ck.root, 'ca')
  await initCa(caDir)
  alice = (await issueKey(caDir, { name: 'alice' })).token
  mallory = (await issueKey(caDir, { name: 'mallory' })).token
  await revokeNode(caDir, 'mallory')
  expect(() => validateConfig({ models: [{ dir: ck.modelDir }], api: { host: '127.0.0.1', port: 0 }, device: 'cpu', dataDir: join(ck.root, 'data'), cacheRoot: join(ck.root, 'cache'), listen: [], bootstrap: [], mdns: false, requireKeys: true }))
    .toThrow(/--require-keys: needs a CA/)
  const daemon = createDaemon(validateConfig({
    models: [{ dir: ck.modelDir }],
    api: { host: '127.0.0.1', port: 0 },
    device: 'cpu',
    dataDir: join(ck.root, 'data'),
    cacheRoot: join(ck.root, 'cache'),
    listen: [],
    bootstrap: [],
    mdns: false,
    requireKeys: true,
    caFile: join(caDir, 'ca.cert.json'),
    revocationsFile: join(caDir, 'revocations.json'),
  }), { logger: pino({ level: 'silent' }) })
  url = (await daemon.start()).apiUrl!
  stop = daemon.stop
})
afterAll(async () => {
  await stop?.()
  await ck?.cleanup()
})

describe('shoal serve --require-keys', () => {
  it('serves a CA key, refuses none, a revoked one and a foreign string; the receipt names the key', async () => {
    const client = (apiKey: string) => new OpenAI({ baseURL: `${url}/v1`, apiKey, maxRetries: 0 })
    const { data, response } = await client(alice).completions.create({ model: MODEL_ID, prompt: 'Hello', max_tokens: 4, temperature: 0 }).withResponse()
    expect(data.usage?.completion_tokens).toBeGreaterThan(0)
    const receiptId = response.headers.get('x-shoal-receipt')!
    const receipt = await (await fetch(`${url}/v1/receipts/${receiptId}`, { headers: { authorization: `Bearer ${alice}` } })).json() as { body: { client?: { name: string } } }
    expect(receipt.body.client?.name).toBe('alice')
    for (const [apiKey, reason] of [[mallory, 'revoked'], ['sk-not-a-shoal-key', 'malformed']]) {
      const err = await client(apiKey!).completions.create({ model: MODEL_ID, prompt: 'Hello', max_tokens: 4 }).catch((e: unknown) => e)
      expect(err).toBeInstanceOf(AuthenticationError)
      expect(((err as AuthenticationError).error as { message: string }).message).toContain(reason)
    }
    const anonymous = await fetch(`${url}/v1/models`)
    expect(anonymous.status).toBe(401)
    expect(((await anonymous.json()) as { error: { code: string } }).error.code).toBe('SHOAL_ERR_INVALID_API_KEY')
  })
})
