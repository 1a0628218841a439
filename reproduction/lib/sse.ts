/**
 * The benchmarks' server-sent-event reader: the text of every event of a streaming response, in
 * order, as it arrives (events end with a blank line; a partial one waits for its next chunk).
 */
export async function * sseEvents (body: ReadableStream<Uint8Array> | null): AsyncGenerator<string> {
  if (body === null) return
  const decoder = new TextDecoder()
  let buf = ''
  for await (const chunk of body as unknown as AsyncIterable<Uint8Array>) {
    buf += decoder.decode(chunk, { stream: true })
    let cut: number
    while ((cut = buf.indexOf('\n\n')) >= 0) {
      yield buf.slice(0, cut)
      buf = buf.slice(cut + 2)
    }
  }
}

/** One chunk of a streamed completion that carried token ids, and when it was read (performance.now()). */
export interface TokenChunk { ids: number[], at: number }

/**
 * The token ids of a streaming completion asked with `return_token_ids: true`, chunk by chunk as
 * they arrive; chunks without ids (the final one, keep-alives) are passed over, `[DONE]` ends it,
 * and an error event throws, naming `from`.
 */
export async function * tokenChunks (body: ReadableStream<Uint8Array> | null, from: string): AsyncGenerator<TokenChunk> {
  for await (const event of sseEvents(body)) {
    if (event === 'data: [DONE]') return
    if (!event.startsWith('data: {')) continue
    const data = JSON.parse(event.slice(6)) as { error?: unknown, choices?: Array<{ token_ids?: number[] }> }
    if (data.error !== undefined) throw new Error(`stream error from ${from}: ${JSON.stringify(data.error)}`)
    const ids = data.choices?.[0]?.token_ids ?? []
    if (ids.length > 0) yield { ids, at: performance.now() }
  }
}
