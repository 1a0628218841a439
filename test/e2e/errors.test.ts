/**
 * The daemon given a Hugging Face checkpoint directly (it compiles it into its cache on start),
 * and every error status of the contract with the real engine behind the ingress: each answer is
 * OpenAI-shaped, the openai client maps it to its error class, and the server keeps serving.
 */
import { existsSync } from 'node:fs'
import { readdir } from 'node:fs/promises'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { APIError, BadRequestError, NotFoundError } from 'openai'
import { MODEL_ID, makeTinyCheckpoint, startDaemon } from './daemon.ts'
import type { RunningDaemon, TinyCheckpoint } from './daemon.ts'

/** The tiny model's max_position_embeddings. */
const CONTEXT = 2048

let ck: TinyCheckpoint
let d: RunningDaemon

beforeAll(async () => {
  ck = await makeTinyCheckpoint({ compile: false })
  d = await startDaemon(ck.modelDir, ck.root)
})
afterAll(async () => {
  await d?.stop()
  await ck?.cleanup()
})

interface ErrorBody { error: { message: string, type: string, param: string | null, code: string } }

/** Checks OpenAI's error shape and returns the error object. */
function openAIError (json: unknown): ErrorBody['error'] {
  const e = (json as ErrorBody).error
  expect(Object.keys(json as object)).toEqual(['error'])
  expect(Object.keys(e).sort()).toEqual(['code', 'message', 'param', 'type'])
  expect(typeof e.message).toBe('string')
  expect(e.message.length).toBeGreaterThan(0)
  expect(typeof e.type).toBe('string')
  expect(e.param === null || typeof e.param === 'string').toBe(true)
  expect(e.code).toMatch(/^SHOAL_ERR_[A-Z_]+$/)
  return e
}

async function post (path: string, body: string | Uint8Array, contentType = 'application/json'): Promise<{ status: number, error: ErrorBody['error'] }> {
  const res = await fetch(`${d.url}${path}`, { method: 'POST', headers: { 'content-type': contentType }, body })
  expect(res.headers.get('content-type')).toMatch(/^application\/json/)
  return { status: res.status, error: openAIError(await res.json()) }
}

/** The openai client's error for a request that must fail. */
async function failure (request: Promise<unknown>): Promise<APIError> {
  const err = await request.then(() => undefined, (e: unknown) => e)
  expect(err).toBeInstanceOf(APIError)
  return err as APIError
}

describe('shoal serve with a Hugging Face checkpoint directory', () => {
  it('compiles the checkpoint into its cache once and serves it under its model id', async () => {
    const entries = (await readdir(join(d.cacheRoot, 'shards'))).filter(e => !e.startsWith('.'))
    expect(entries).toHaveLength(1)
    expect(existsSync(join(d.cacheRoot, 'shards', entries[0]!, 'manifest.json'))).toBe(true)
    expect((await d.client.models.list()).data.map(m => m.id)).toEqual([MODEL_ID])
    const chat = await d.client.chat.completions.create({ model: MODEL_ID, messages: [{ role: 'user', content: 'hi' }], max_tokens: 4, temperature: 0 })
    expect(chat.usage?.completion_tokens).toBe(4)
  })
})

describe('every error status of the contract, with the real engine', () => {
  it('400 for malformed JSON', async () => {
    for (const path of ['/v1/chat/completions', '/v1/completions']) {
      const { status, error } = await post(path, '{"model": "tiny-e2e", "messages": [')
      expect(status).toBe(400)
      expect(error.type).toBe('invalid_request_error')
      expect(error.code).toBe('SHOAL_ERR_BAD_REQUEST')
    }
  })

  it('400 for wrong types, naming the parameter', async () => {
    const bad = await post('/v1/chat/completions', JSON.stringify({ model: MODEL_ID, messages: 'hello' }))
    expect(bad.status).toBe(400)
    expect(bad.error.param).toBe('messages')
    const viaClient = await failure(d.client.chat.completions.create({ model: MODEL_ID, messages: [{ role: 'user', content: 'hi' }], max_tokens: 'ten' as unknown as number }))
    expect(viaClient).toBeInstanceOf(BadRequestError)
    expect(viaClient.status).toBe(400)
    expect(viaClient.param).toBe('max_tokens')
    const temp = await failure(d.client.completions.create({ model: MODEL_ID, prompt: 'hi', temperature: 'hot' as unknown as number }))
    expect(temp.status).toBe(400)
    expect(temp.param).toBe('temperature')
    const ids = await failure(d.client.completions.create({ model: MODEL_ID, prompt: [1, -5, 3] }))
    expect(ids.status).toBe(400)
    // A token id outside the vocabulary is caught by the engine, before any work.
    const vocab = await failure(d.client.completions.create({ model: MODEL_ID, prompt: [1, 999_999] }))
    expect(vocab.status).toBe(400)
    expect(vocab.code).toBe('SHOAL_ERR_BAD_REQUEST')
  })

  it('404 for an unknown model', async () => {
    const err = await failure(d.client.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'hi' }] }))
    expect(err).toBeInstanceOf(NotFoundError)
    expect(err.status).toBe(404)
    expect(err.code).toBe('SHOAL_ERR_MODEL_NOT_FOUND')
    expect(err.message).toContain(MODEL_ID)
    const raw = await post('/v1/completions', JSON.stringify({ model: 'no-such-model', prompt: 'hi' }))
    expect(raw.status).toBe(404)
  })

  it('413 for a prompt longer than the context', async () => {
    const ids = Array.from({ length: CONTEXT }, (_, i) => 3 + (i % 400))
    const tokens = await failure(d.client.completions.create({ model: MODEL_ID, prompt: ids, max_tokens: 1 }))
    expect(tokens.status).toBe(413)
    expect(tokens.code).toBe('SHOAL_ERR_CONTEXT_LENGTH')
    // Text and chat prompts are measured after tokenizing (and rendering the chat template).
    const text = 'The quick brown fox jumps over the lazy dog. '.repeat(400)
    const chat = await failure(d.client.chat.completions.create({ model: MODEL_ID, messages: [{ role: 'user', content: text }] }))
    expect(chat.status).toBe(413)
    const raw = await post('/v1/completions', JSON.stringify({ model: MODEL_ID, prompt: text }))
    expect(raw.status).toBe(413)
    expect(raw.error.code).toBe('SHOAL_ERR_CONTEXT_LENGTH')
  })

  it('400 for n > 1', async () => {
    const err = await failure(d.client.chat.completions.create({ model: MODEL_ID, messages: [{ role: 'user', content: 'hi' }], n: 2 }))
    expect(err).toBeInstanceOf(BadRequestError)
    expect(err.param).toBe('n')
    const raw = await post('/v1/completions', JSON.stringify({ model: MODEL_ID, prompt: 'hi', n: 3 }))
    expect(raw.status).toBe(400)
    expect(raw.error.param).toBe('n')
  })

  it('413 for a body over the limit', async () => {
    const huge = JSON.stringify({ model: MODEL_ID, prompt: 'x'.repeat(9 * 1024 * 1024) })
    const { status, error } = await post('/v1/completions', huge)
    expect(status).toBe(413)
    expect(error.code).toBe('SHOAL_ERR_BODY_TOO_LARGE')
  })

  it('keeps serving after all of them', async () => {
    expect(await (await fetch(`${d.url}/healthz`)).json()).toEqual({ status: 'ok' })
    const ok = await d.client.completions.create({ model: MODEL_ID, prompt: 'Once upon a time', max_tokens: 8, temperature: 0 })
    expect(ok.choices[0]!.finish_reason).toBe('length')
    expect(ok.usage!.completion_tokens).toBe(8)
  })
})
