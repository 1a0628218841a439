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
