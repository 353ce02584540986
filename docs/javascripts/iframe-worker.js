// The site's search runs in a Web Worker, which browsers refuse to start for a page opened from
// disk (file://). There, this runs the worker's script in a hidden iframe instead, passing the
// messages both ways, so search works offline from file:// too. Served over HTTP it does
// nothing. (Material's offline plugin would load a shim like this from unpkg.com; this one is
// part of the site.)
(function () {
  "use strict";
  if (location.protocol !== "file:") return;

  class FrameWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.onerror = null;
      this._queue = [];
      this._frame = document.createElement("iframe");
      this._frame.hidden = true;
      document.documentElement.appendChild(this._frame);
      const scope = this._frame.contentWindow;
      // the worker's script posts with the global postMessage: answer to this object
      scope.postMessage = (data) => setTimeout(() => this._emit("message", data));
      const script = scope.document.createElement("script");
      script.src = new URL(url, location.href).href;
      script.onload = () => {
        const waiting = this._queue;
        this._queue = null;
        waiting.forEach((data) => this.postMessage(data));
      };
      script.onerror = () => this._emit("error", null);
      scope.document.head.appendChild(script);
    }

    postMessage(data) {
      if (this._queue !== null) {
        this._queue.push(data);
        return;
      }
      const scope = this._frame.contentWindow;
      setTimeout(() => scope.dispatchEvent(new scope.MessageEvent("message", { data })));
    }

    terminate() {
      this._frame.remove();
    }

    _emit(type, data) {
      const event = type === "message" ? new MessageEvent("message", { data }) : new Event(type);
      const handler = type === "message" ? this.onmessage : this.onerror;
      if (handler) handler.call(this, event);
      this.dispatchEvent(event);
    }
  }

  window.Worker = FrameWorker;
})();
